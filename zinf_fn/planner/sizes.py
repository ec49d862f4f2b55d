"""``zf.estimate``: a config's bytes per tier and kind, peak memory and traffic, before anything is
allocated.

The layout comes from a *layout build* (``zinf_fn.layout.build.layout``): the same code path as
``zf.init``, with tiers that only record shapes, so the bytes are exactly what init allocates; the
first unit of each group is initialised once to learn its flat layout (one layer, never the model).
The memory model on top of it is ``planner.memory``. With a sample ``batch``, one micro-batch is run
through the embedding, one block and the head (under ``no_grad``) to size the activations and count
the matmul FLOPs a step does (``Work``); for a prediction (``plan_config(timed=True)``) the same
three units are also timed as a training step runs them (``plan.compute``), which the step-time
prediction (``plan.timing``) prefers to the FLOPs over a generic FLOP/s.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..config import Config
from ..formats.codebook import Decode
from ..formats.nf4_linear import LentLeaves
from ..layout.build import layout
from ..layout.demand import Sizing
from ..layout.policy import lent_leaves
from ..layout.units import BLOCKS, EMBED, HEAD, Unit, head_index, stage_rows, units
from ..model import block_apply, with_ties
from ..overlap.plan import train_plan
from ..overlap.tile_runs import kept_tiles
from ..tiling.deferred import materialize
from ..tiling.ops import is_tiled, untile
from ..tiling.plan import step_fetches, step_reads
from . import experts, fit, memory
from .compute import recomputed_leaves, time_stages
from .memory import Traffic, nvme_traffic


class Work(NamedTuple):
    """What one step computes and moves: forward matmul FLOPs of all micro-batches (and, timed, the
    seconds of its compute), the elements updated, the NVMe bytes per phase."""

    forward_flops: float  # embed + every block + head, one forward pass over the whole batch
    head_flops: float  # of which the head (its backward runs without a recompute)
    # trainable parameters (elements updated per step; padding, frozen leaves excluded)
    params: int
    # units fetched in forward (the backward fetches one fewer: not the head)
    units: int = 0
    # measured seconds of the forward scan's compute (``plan.compute``)
    forward_s: float | None = None
    backward_s: float | None = None  # ... of the head and the reverse scan; None: not timed
    disk: Traffic = Traffic()  # NVMe bytes per phase (``memory.nvme_traffic``)
    # tile fetches of the forward scan, of the head and the backward
    tile_fetches: tuple[float, float] = (0, 0)


class Planned(NamedTuple):
    estimate: memory.Estimate
    work: Work | None  # None without a sample batch


def estimate(
    model, optimizer, config: Config | None = None, batch: Any = None, top_k: int | None = None
) -> memory.Estimate:
    """Bytes of every state kind in every tier (this rank), peak host and device working memory and
    bytes moved per step per tier, for ``config`` ("auto" resolved as ``zf.init`` resolves it);
    nothing is allocated but one layer per group. ``batch`` (a sample batch, this rank's part):
    activations too. A model whose experts stream (``planner.experts``) has them counted; with
    ``batch`` and its routers' ``top_k``, the NVMe reads are the expected ones under uniform
    routing."""
    planned = plan_config(model, optimizer, config or Config(), batch, timed=False, top_k=top_k)
    return planned.estimate


def plan_config(
    model,
    optimizer,
    config: Config,
    batch: Any = None,
    trees: dict | None = None,
    timed: bool = True,
    top_k: int | None = None,
) -> Planned:
    """``estimate`` and, with ``batch``, the step's ``Work``, its compute timed unless ``timed`` is
    False (``plan.compute``: seconds on a CPU, one layer of each stage). ``trees`` caches the first
    units' trees (by unit index) and the stage timings (by compute dtype, device and micro-batch
    count) across calls (the shapes only, without ``batch``). ``top_k``: the experts each token is
    routed to, for a model whose experts stream (``planner.experts``: the expected share of them a
    step reads)."""
    trees = {} if trees is None else trees

    def built_of(config_: Config):
        # without a batch nothing runs the trees: their shapes are kept, not a layer's memory
        return layout(model, optimizer, config_, trees, shapes_only=batch is None)

    config = fit.resolve(config, built_of, model.n_layers)
    built = built_of(config)
    tokens = None if batch is None else _routed_tokens(batch, config.grad_accum)
    if batch is not None:  # the blocks' recompute, as the engine's first step learns it
        _observe_recompute(model, trees, batch, config, built)
    found = experts.count(built, config, top_k, tokens)
    est = experts.with_experts(memory.estimate(built, config), found)
    if batch is None:
        return Planned(est, None)
    carry, layer, work = _measure(model, trees, batch, config, _timing(built) if timed else None)
    params = sum(
        g.spec.numel * g.rows
        for g in built.store.groups.values()
        if g.name not in built.store.row_kinds.frozen
    )
    est = memory.with_activations(est, carry, layer, model.n_layers)
    kept = _kept_share(config, layer, model)
    disk = _expected_traffic(nvme_traffic(built, config), found)
    sized = memory.sizing(built, config)
    reads = step_reads(built.tiles, built.store, sized)
    est, disk = _without(est, disk, _kept_reads(reads, found, kept))
    est, disk = _without(est, disk, _kept_tile_reads(built.store, sized, reads, found, kept))
    return Planned(
        est,
        work._replace(
            params=params,
            units=head_index(model.n_layers) + 1,
            disk=disk,
            tile_fetches=_tile_fetches(built, config, found, kept),
        ),
    )


def _routed_tokens(batch: Any, grad_accum: int) -> int:
    """The tokens of one micro-batch a block routes: the elements of the batch's first leaf (its
    token ids, ``"inputs"``) over ``grad_accum``."""
    return optree.tree_leaves(batch)[0].numel() // grad_accum


def _expected_traffic(disk: Traffic, found: experts.Experts | None) -> Traffic:
    """``disk`` less the expert reads a step is not expected to make (``planner.experts``)."""
    if found is None:
        return disk
    (forward, backward), (want_f, want_b) = found.reads, found.expected_reads
    return disk._replace(
        read_forward=disk.read_forward - forward + want_f,
        read_backward=disk.read_backward - backward + want_b,
    )


def _observe_recompute(model, trees: dict, batch: Any, config: Config, built) -> None:
    """Record in ``built``'s tile layout which tiled leaves a block's backward recomputes
    (``compute.recomputed_leaves`` on one micro-batch through layer 0, cached in ``trees``), as the
    engine records it after its first backward unit (``TileLayout.observe_recompute``): the tile
    plan then reads what the engine's steps read."""
    if not built.tiles.leaves.get(BLOCKS):
        return
    dtype = config.resolved_compute_dtype()
    frozen = built.frozen.of(Unit(1, BLOCKS, 0))
    key = ("recomputed leaves", dtype, config.grad_accum, frozen)
    if key not in trees:
        micro = optree.tree_map(lambda x: x.chunk(config.grad_accum)[0], batch)
        embed = _params(trees[0], dtype, whole=True)
        with torch.no_grad():
            carry = model.embed.apply(embed, micro)
        block = _params(trees[1], dtype, whole=False)
        trees[key] = recomputed_leaves(model, block, carry, frozen)
    built.tiles.observe_recompute(BLOCKS, trees[key])


def _kept_share(config: Config, layer_bytes: int, model) -> float:
    """The share of the blocks' tapes (one per block and micro-batch) whose activations
    ``Config.keep_activations`` holds, ``layer_bytes`` each (an upper bound, ``_measure``: the share
    is a lower bound); their backward units recompute nothing (``scan.tape.Kept``)."""
    tapes = model.n_layers * config.grad_accum
    return min(tapes, config.keep_activations // max(layer_bytes, 1)) / tapes


def _touched(group: str, found: experts.Experts | None) -> float:
    """The share of ``group``'s tiles a step is expected to fetch: an expert group's touched share
    (``planner.experts``), every tile of any other."""
    return found.share if found is not None and group in found.groups else 1.0


def _tile_fetches(
    built, config: Config, found: experts.Experts | None, kept: float = 0.0
) -> tuple[float, float]:
    """(tile fetches of the forward scan, of the head and the reverse scan) of one training step:
    the tile plan's (``tiling.plan.step_fetches``), each counted in the phase that computes with it;
    an expert's counted as the share of experts a step is expected to touch, a recompute's as the
    share of tapes not kept (``kept``, ``_kept_share``: a kept block's backward unit fetches no
    tile for a recompute, ``tiling.routed.without_recompute``)."""
    plan = train_plan(units(built.n_layers), built.frozen.embed_trains())
    counts = {"forward": 0.0, "backward": 0.0}
    for fetch in step_fetches(built.tiles, plan, config.grad_accum):
        again = 1.0 - kept if fetch.recompute else 1.0
        counts[fetch.phase] += _touched(fetch.op.unit.group, found) * again
    return counts["forward"], counts["backward"]


def _kept_reads(reads: dict, found: experts.Experts | None, kept: float) -> int:
    """The NVMe bytes of the tile recomputes that kept tapes skip (``kept``: their share, of the
    tile plan's recompute reads, ``tiling.plan.step_reads``), an expert group's at its touched
    share."""
    return int(sum(r.recompute * kept * _touched(g, found) for g, r in reads.items()))


def _kept_tile_reads(
    store, sizing: Sizing, reads: dict, found: experts.Experts | None, kept: float
) -> int:
    """The NVMe bytes the tiles ``Config.keep_tiles`` keeps spare a step (``tiling.keep``): each
    kept tile (as many of each group as ``overlap.tile_runs.kept_tiles`` allows, at most the
    group's tiles a step is expected to touch) read once instead of as often as the tile plan
    fetches it (``tiling.plan.step_reads``: each micro-batch's forward, the backward, the recompute
    at the share of tapes not kept, ``kept``). An upper bound: a tile whose backward fetch was
    issued ahead of its forward release (the last layer's, across the turn) is read again."""
    limits = kept_tiles(store, sizing.compute, sizing.world_size, sizing.keep_tiles)
    spared = 0.0
    for group, most in limits.items():
        r = reads.get(group)
        if r is None or not r.forward:
            continue
        row = store.row_kinds.row_nbytes("param", group)
        tiles = r.forward // (row * sizing.grad_accum)  # its tiles on NVMe
        fetches = (r.forward + r.backward - r.recompute * kept) / (tiles * row)  # a tile's
        spared += min(most, tiles * _touched(group, found)) * row * max(fetches - 1.0, 0.0)
    return int(spared)


def _without(est: memory.Estimate, disk: Traffic, unread: int):
    """(``est``, ``disk``) less ``unread`` NVMe bytes of the backward's reads."""
    if not unread:
        return est, disk
    moved = {**est.moved, "nvme": est.moved["nvme"] - unread}
    return est._replace(moved=moved), disk._replace(read_backward=disk.read_backward - unread)


class _OutputBytes(TorchDispatchMode):
    """Sums the bytes of every tensor an op returns: an upper bound of what a vjp saves."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.total += sum(t.nbytes for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


class _Timing(NamedTuple):
    """What timing the stages as the engine runs them needs of the layout: by stage, then key
    path, the tiled weights whose codes the engine lends to their ops and how they are stored
    (``GroupPolicy.codes_lent``) or the dtype they are lent in as stored (``lent_as``), and the
    leaves without gradient of each stage's unit tree (``FrozenLeaves.of``), and the block's frozen
    linears lent as their codes (``layout.policy.lent_leaves``)."""

    lent: dict[str, dict[str, Decode | torch.dtype]]
    frozen: dict[str, tuple[int, ...]]
    block_lent: LentLeaves | None = None

    def key(self) -> tuple:
        """What of it changes the timing: the lent weights' names and the frozen leaves."""
        lent = tuple(sorted((stage, path) for stage, paths in self.lent.items() for path in paths))
        return lent, tuple(sorted(self.frozen.items())), self.block_lent


def _timing(built) -> _Timing:
    """``built``'s ``_Timing``."""
    lent: dict[str, dict[str, Decode | torch.dtype]] = {}
    for stage, leaves in built.tiles.leaves.items():
        for leaf in leaves:
            policy = built.store.row_kinds.policy(leaf.group)
            how = policy.codes_lent if policy.codes_lent is not None else policy.lent_as
            if how is not None:
                lent.setdefault(stage, {})[leaf.path] = how
    first = (Unit(0, EMBED, 0), Unit(1, BLOCKS, 0), Unit(head_index(built.n_layers), HEAD, 0))
    frozen = {unit.group: built.frozen.of(unit) for unit in first}
    return _Timing(lent, frozen, lent_leaves(built.store.row_kinds.policy))


def _measure(
    model, trees: dict, batch: Any, config: Config, timing: _Timing | None
) -> tuple[int, int, Work]:
    """(carry bytes of the whole batch, one block's activation bytes, the step's Work), from one
    micro-batch; its compute timed as ``timing`` says, or not at all where it is None."""
    k = config.grad_accum
    micro = optree.tree_map(lambda x: x.chunk(k)[0], batch)
    dtype = config.resolved_compute_dtype()
    embed, block, head = (
        _params(trees[i], dtype, whole=True) for i in (0, 1, head_index(model.n_layers))
    )
    # what the head applies to: its tree and the tied leaves
    head = with_ties(model.ties, head, embed)
    with torch.no_grad():
        with FlopCounterMode(display=False) as embed_flops:
            carry = model.embed.apply(embed, micro)
        with _OutputBytes() as outputs, FlopCounterMode(display=False) as block_flops:
            block_apply(model, 0)(block, carry)
        with FlopCounterMode(display=False) as head_flops:
            model.head.apply(head, carry, micro)
    carry_bytes = sum(t.nbytes for t in optree.tree_leaves(carry))
    rows = {EMBED: 1, BLOCKS: stage_rows(BLOCKS, model.n_layers), HEAD: 1}
    forward = k * (
        embed_flops.get_total_flops()
        + rows[BLOCKS] * block_flops.get_total_flops()
        + head_flops.get_total_flops()
    )
    work = Work(float(forward), float(k * head_flops.get_total_flops()), 0)
    if timing is not None:
        device = config.resolved_device()
        # the same for every placement of one model and batch
        key = ("stage seconds", dtype, str(device), k, timing.key())
        if key not in trees:
            embed, block, head = (
                _params(trees[i], dtype, whole=False) for i in (0, 1, head_index(model.n_layers))
            )
            trees[key] = time_stages(
                model,
                embed,
                block,
                with_ties(model.ties, head, embed),
                micro,
                device,
                timing.lent,
                timing.frozen,
                timing.block_lent,
            )
        work = work._replace(
            forward_s=trees[key].forward(rows[BLOCKS], k),
            backward_s=trees[key].backward(rows[BLOCKS], k),
        )
    return k * carry_bytes, outputs.total, work


def _params(tree: Any, dtype: torch.dtype, whole: bool) -> Any:
    """A unit's initial tree in the compute dtype; ``whole``: each tiled weight rejoined (sizing the
    activations and counting FLOPs needs no tiling: a tiled op makes the untiled op's output), else
    as its tiles (timing)."""
    if whole:
        tree = optree.tree_map(untile, tree, is_leaf=is_tiled)
    tree = materialize(tree)  # deferred tiles (tiling.Deferred) made
    return optree.tree_map(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)
