"""``zf.auto_config``: every candidate placement estimated and timed; the fastest one that fits
wins.

Candidates: params in "none", "cpu", "nvme" (and "auto" with a device budget on CUDA) times the
optimizer in "none", "cpu", "nvme" and "auto" (RAM up to the host budget, the rest spilled to NVMe);
NVMe only with an ``nvme_path``. Each is estimated (``plan.sizes``), checked against the budgets and
the disk (``fit.problems``) and timed (``plan.timing``) on this machine (``plan.machine``).

Given a factory of tile counts instead of a model (``lambda mlp_tiles, head_tiles: ...``), the tiles
are chosen too (``auto_tiles``): the combinations of ``tile_counts`` for the factory's parameters
are weighed in order of their total, fewest first, every placement of each; the first total at which
a placement fits wins, with its fastest fitting placement. Tiles cost a fetch and a dispatch each,
and bound the working memory only: never more of them than the budgets need.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

from ..config import Config
from ..model import Model
from .fit import problems
from .machine import Machine, calibrate
from .memory import MIB, Estimate
from .sizes import plan_config
from .timing import StepTime, predict

# the counts weighed for each parameter of a factory of tile counts
TILE_COUNTS = (1, 2, 4, 8, 16, 32, 64)


class Candidate(NamedTuple):
    config: Config
    estimate: Estimate
    time: StepTime | None  # None without a sample batch (no work to time)
    problems: list[str]


def candidates(
    model,
    optimizer,
    base: Config,
    batch: Any,
    machine: Machine,
    top_k: int | None = None,
    trees: dict | None = None,
) -> list[Candidate]:
    """Every placement of ``base``'s budgets and nvme_path, estimated, checked and timed
    (``top_k``: the routers' experts per token, ``planner.experts``; ``trees``: ``plan_config``'s
    cache of the model's trees and stage timings, made here if not given)."""
    slow = ["nvme"] if base.nvme_path else []
    params = ["none", "cpu", *slow] + (["auto"] if base.device_memory_budget is not None else [])
    optim = ["none", "cpu", *slow] + (
        ["auto"] if slow and base.host_memory_budget is not None else []
    )
    out, seen, trees = [], set(), {} if trees is None else trees
    for p in params:
        for o in optim:
            config = dataclasses.replace(base, offload_params=p, offload_optimizer=o)
            planned = plan_config(model, optimizer, config, batch, trees, top_k=top_k)
            if planned.estimate.config in seen:  # an "auto" that resolved to a plain placement
                continue
            seen.add(planned.estimate.config)
            time = predict(planned.estimate, planned.work, machine) if planned.work else None
            out.append(
                Candidate(
                    planned.estimate.config, planned.estimate, time, problems(planned.estimate)
                )
            )
    return out


def best(found: list[Candidate]) -> Candidate:
    """The fitting candidate with the lowest predicted step time; on a tie (or without times) the
    one that moves the fewest bytes to and from its tiers."""
    fitting = [c for c in found if not c.problems]
    if not fitting:
        raise ValueError(
            "zf.auto_config: no placement fits the budgets:\n" + format_candidates(found)
        )
    return min(
        fitting,
        key=lambda c: (round(c.time.step, 3) if c.time else 0.0, sum(c.estimate.moved.values())),
    )


HEADER = (
    f"{'params':14s} {'optimizer':14s} {'host MiB':>9s} {'device MiB':>10s} {'disk MiB':>9s}"
    "  predicted"
)


def format_candidates(found: list[Candidate], chosen: Candidate | None = None) -> str:
    """One line per candidate: placements, peaks, disk, predicted seconds per phase, and why it does
    not fit."""
    return "\n".join([f"  {HEADER}", *(_row(c, chosen) for c in found)])


def _row(c: Candidate, chosen: Candidate | None, prefix: str = "") -> str:
    e, mark = c.estimate, "*" if c is chosen else " "
    time = c.time.row() if c.time else "(no batch: not timed)"
    why = f"  DOES NOT FIT: {'; '.join(c.problems)}" if c.problems else ""
    return (
        f"{mark} {prefix}{_placement(c.config, 'params'):14s} "
        f"{_placement(c.config, 'optimizer'):14s} "
        f"{e.host_peak / MIB:9.1f} {e.device_peak / MIB:10.1f} {e.disk / MIB:9.1f}  "
        f"{time}{why}"
    )


def _kept(config: Config) -> str:
    """The chosen config's kept tiles, where it keeps any."""
    if not config.keep_tiles:
        return ""
    return f", keep_tiles {config.keep_tiles / MIB:.1f} MiB"


def _placement(config: Config, kind: str) -> str:
    spill = getattr(config, f"spill_{kind}")
    return config.placement(kind) + (f">{spill}" if spill else "")


def auto_config(
    model,
    optimizer,
    nvme_path: str | None = None,
    host_memory_budget: int | None = None,
    device_memory_budget: int | None = None,
    batch: Any = None,
    base: Config | None = None,
    machine: Machine | None = None,
    verbose: bool = True,
    tile_counts: tuple[int, ...] = TILE_COUNTS,
    top_k: int | None = None,
) -> Config | TilesChoice:
    """The Config (placements and split; the rest from ``base``) that fits the budgets and has the
    lowest predicted step time on this machine (``calibrate(nvme_path)`` unless ``machine`` is
    given); prints its reasoning (every candidate, then the chosen one's tiers x kinds table) when
    ``verbose``. ``batch``: a sample batch, which the step time needs; without one the least
    offloaded fit wins. ``model`` may be a factory of tile counts (``lambda mlp_tiles, head_tiles:
    ...`` returning a zf.Model): then the fewest tiles (of ``tile_counts`` each) under which a
    placement fits are chosen too (``auto_tiles``), and a ``TilesChoice`` (config, tiles, model) is
    returned. ``top_k``: for a model whose experts stream, the experts each token is routed to
    (the NVMe reads are then the expected ones, ``planner.experts``)."""
    base = dataclasses.replace(
        base or Config(),
        nvme_path=nvme_path,
        host_memory_budget=host_memory_budget,
        device_memory_budget=device_memory_budget,
    )
    machine = machine or calibrate(nvme_path)
    if not isinstance(model, Model):
        return auto_tiles(model, optimizer, base, batch, machine, tile_counts, verbose, top_k)
    trees: dict = {}
    found = candidates(model, optimizer, base, batch, machine, top_k, trees)
    picked = best(found)
    chosen = with_kept_tiles(picked, model, optimizer, batch, machine, top_k, trees)
    if verbose:
        print(report(found, picked, chosen))
    return chosen.config


def with_kept_tiles(
    chosen: Candidate,
    model,
    optimizer,
    batch: Any,
    machine: Machine,
    top_k: int | None = None,
    trees: dict | None = None,
) -> Candidate:
    """``chosen`` with ``Config.keep_tiles`` set to the host budget's room above its estimate, at
    most the bytes a step's forward reads (no more is ever kept), where that keeps frozen streamed
    tiles (a LoRA base's experts on NVMe, one rank: ``overlap.tile_runs.kept_tiles``) and the
    config leaves it at 0: the kept tiles' buffers are the estimate's too (the pool reserves them),
    so the estimate stays within the budget, and their backward reads leave the predicted step.
    Unchanged where the caller set ``keep_tiles``, gave no host budget or no batch (the reads are
    the batch's), or nothing would be kept (the estimate does not grow). ``trees``: the cache
    ``candidates`` planned the model with (its stage timings are not measured again)."""
    config = chosen.config
    budget = config.host_memory_budget
    if config.keep_tiles or budget is None or batch is None:
        return chosen
    room = budget - chosen.estimate.host_peak
    if room <= 0:
        return chosen

    def keeping(nbytes: int):
        kept = dataclasses.replace(config, keep_tiles=nbytes)
        return plan_config(model, optimizer, kept, batch, trees, top_k=top_k)

    planned = keeping(room)
    useful = planned.work.disk.read_forward  # a step's forward reads: no more is ever kept
    if 0 < useful < room:
        planned = keeping(useful)
    trouble = problems(planned.estimate)
    if planned.estimate.host_peak == chosen.estimate.host_peak or trouble:
        return chosen
    return Candidate(
        planned.estimate.config,
        planned.estimate,
        predict(planned.estimate, planned.work, machine),
        trouble,
    )


def report(found: list[Candidate], picked: Candidate, chosen: Candidate) -> str:
    """The candidates' table (``picked`` marked) and the chosen config's (``picked``'s, its kept
    tiles set: ``with_kept_tiles``) estimate table."""
    return (
        f"zf.auto_config: {len(found)} placements (* chosen)\n{format_candidates(found, picked)}\n"
        f"chosen: params {_placement(chosen.config, 'params')}, optimizer "
        f"{_placement(chosen.config, 'optimizer')}{_kept(chosen.config)}\n"
        f"{chosen.estimate.table()}"
    )


# -- the tiles: a factory of tile counts
# ------------------------------------------------------------


class Weighed(NamedTuple):
    """One combination of tile counts: every placement of the model built with them, or why the
    factory refused them (then ``found`` is empty)."""

    tiles: dict[str, int]
    found: list[Candidate]
    refused: str | None = None

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.tiles.items())


class TilesChoice(NamedTuple):
    """What ``zf.auto_config`` chose for a factory of tile counts: the config, the counts, the model
    built with them."""

    config: Config
    tiles: dict[str, int]
    model: Model


def tile_names(factory: Callable) -> list[str]:
    """The tile counts a factory takes: its parameters' names (each passed by name)."""
    if not callable(factory):
        raise TypeError(
            "zf.auto_config expects a zf.Model or a factory of tile counts (e.g. lambda "
            "mlp_tiles, "
            "head_tiles: llama.model(cfg._replace(mlp_tiles=mlp_tiles, "
            "head_tiles=head_tiles))), "
            f"got {type(factory).__name__}"
        )
    params = list(inspect.signature(factory).parameters.values())
    loose = [p.name for p in params if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not params or loose:
        raise TypeError(
            f"zf.auto_config: a factory of tile counts names each count as a parameter (lambda "
            f"mlp_tiles, head_tiles: ...), got parameters {[p.name for p in params]}"
            + (f" with *{loose[0]}" if loose else "")
        )
    return [p.name for p in params]


def tile_combinations(names: list[str], counts: tuple[int, ...]) -> list[dict[str, int]]:
    """Every combination of ``counts`` for ``names``, fewest tiles (their sum) first; a tie in value
    order."""
    combos = sorted(
        itertools.product(sorted(set(counts)), repeat=len(names)), key=lambda c: (sum(c), c)
    )
    return [dict(zip(names, c, strict=True)) for c in combos]


def weigh(
    factory: Callable,
    tiles: dict[str, int],
    optimizer,
    base: Config,
    batch: Any,
    machine: Machine,
    top_k: int | None = None,
) -> Weighed:
    """Every placement of ``factory(**tiles)``; a factory that refuses the counts (ValueError) is
    noted."""
    try:
        model = factory(**tiles)
    except ValueError as e:  # e.g. more tiles than a weight has features
        return Weighed(tiles, [], f"{type(e).__name__}: {e}")
    if not isinstance(model, Model):
        raise TypeError(
            f"zf.auto_config: the factory returned {type(model).__name__} for {tiles}, expected a "
            "zf.Model"
        )
    return Weighed(tiles, candidates(model, optimizer, base, batch, machine, top_k))


def auto_tiles(
    factory: Callable,
    optimizer,
    base: Config,
    batch: Any,
    machine: Machine,
    counts: tuple[int, ...] = TILE_COUNTS,
    verbose: bool = True,
    top_k: int | None = None,
) -> TilesChoice:
    """The fewest tiles (sum of the counts) under which a placement fits, and its fastest fitting
    placement.

    Totals are weighed in increasing order, every combination of a total before the next: the first
    total with a fitting placement wins (``best`` among all of its fits); nothing beyond it is
    built."""
    weighed: list[Weighed] = []
    for _, same in itertools.groupby(
        tile_combinations(tile_names(factory), counts), key=lambda t: sum(t.values())
    ):
        level = [weigh(factory, tiles, optimizer, base, batch, machine, top_k) for tiles in same]
        weighed += level
        fits = [(w, c) for w in level for c in w.found if not c.problems]
        if fits:
            picked = best([c for _, c in fits])
            tiles = next(w.tiles for w, c in fits if c is picked)
            model = factory(**tiles)
            chosen = with_kept_tiles(picked, model, optimizer, batch, machine, top_k)
            if verbose:
                print(tiles_report(weighed, picked, chosen))
            return TilesChoice(chosen.config, tiles, model)
    raise ValueError(
        "zf.auto_config: no tile counts and placement fit the budgets:\n"
        + format_weighed(weighed)
        + "\nRaise the budgets, weigh larger counts "
        + f"(tile_counts=, today {tuple(sorted(set(counts)))})"
        + ("" if base.nvme_path else " or give an nvme_path")
    )


def format_weighed(weighed: list[Weighed], chosen: Candidate | None = None) -> str:
    """One line per tile counts and placement (predicted peaks and seconds), and the counts a
    factory refused."""
    width = max(len(w.label()) for w in weighed) + 2
    lines = [f"  {'tiles':{width}s}{HEADER}"]
    for w in weighed:
        if w.refused:
            lines.append(f"  {w.label():{width}s}refused by the factory: {w.refused}")
        lines += [_row(c, chosen, f"{w.label():{width}s}") for c in w.found]
    return "\n".join(lines)


def tiles_report(weighed: list[Weighed], picked: Candidate, chosen: Candidate) -> str:
    """The tiles and placements weighed, the chosen ones (``picked`` marked), and the chosen
    config's estimate table (``report``'s)."""
    tiles = next(w for w in weighed if any(c is picked for c in w.found))
    return (
        f"zf.auto_config: {len(weighed)} tile counts, fewest tiles first (* chosen)\n"
        f"{format_weighed(weighed, picked)}\nchosen: tiles {tiles.label()}, params "
        f"{_placement(chosen.config, 'params')}, optimizer "
        f"{_placement(chosen.config, 'optimizer')}{_kept(chosen.config)}\n"
        f"{chosen.estimate.table()}"
    )
