"""The public engine: ``init``, ``train_step``, ``eval_step`` over an explicit ``TrainState``.

``train_step`` consumes the state it is given (the tier arrays are updated in place, like JAX's
donated arguments) and returns the new one; using the consumed state again raises.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, NamedTuple

import optree
import torch

from .config import Config
from .io.heap import fix_mmap_threshold
from .layout.build import check_model, init_unit, lay_out, layout
from .layout.units import BLOCKS, Unit, units
from .model import Model
from .observe.trace import make_observers
from .offload.tiers import make_tier
from .optim.optimizers import Optimizer
from .partition.comm import current_comm
from .partition.fingerprint import check_agreement, fingerprint
from .partition.sharding import make_sharding
from .planner.fit import check_fit, resolve
from .planner.memory import estimate
from .runtime import Runtime
from .tiling.layout import MADE_AHEAD, split_tiled, tile_shards
from .tree import check_same_spec, flat_spec, flatten_into_


class Lease:
    """Who may use the tier arrays: exactly one live TrainState at a time."""

    def __init__(self):
        self.live = True
        self.consumed_at: int | None = None

    def consume(self, at: int) -> None:
        """No state of this lease may be used from now on; its arrays hold step ``at``."""
        self.live = False
        self.consumed_at = at


class TrainState(NamedTuple):
    model: Model
    optimizer: Optimizer
    config: Config
    step: int
    runtime: Runtime
    lease: Lease


def _build(
    model: Model, optimizer: Optimizer, config: Config | None, seed: int, zero_fill: bool = True
) -> Runtime:
    """The runtime with every array allocated (not yet written).

    The layout step (``zinf_fn.layout.build.lay_out``) over real tiers, then the wiring: the
    runtime, the cross-rank agreement, the kept rows. ``zero_fill=False`` leaves memory-tier arrays
    uninitialised: only for a caller that writes every byte.
    """
    shapes: dict = {}  # the first units' shapes (layout.build.shapes_of), learnt once
    config = _planned(model, optimizer, config or Config(), shapes)
    comm = current_comm(config.collective_timeout_s)
    sharding = make_sharding(config.partition, comm, model.n_layers)
    device = config.resolved_device()
    observers = make_observers(config.trace)
    fix_mmap_threshold(config.resolved_mmap_threshold())

    def made(placement: str, role: str):
        return make_tier(
            placement,
            device,
            config.nvme_path,
            f"rank{comm.rank}/{role}",
            zero_fill,
            observers.tracer,
            observers.io_clock,
            config.nvme_engine,
        )

    def first_tree(unit: Unit) -> Any:
        return shapes[unit.index] if unit.index in shapes else init_unit(model, unit, seed)

    built = lay_out(model, optimizer, config, sharding, made, first_tree)
    runtime = Runtime(model, optimizer, config, built, observers)
    # sync: the one exchange before any training collective; a mismatch raises on every rank
    check_agreement(
        comm.all_gather_object(
            fingerprint(built.store.groups.values(), model.n_layers, config, optimizer, seed)
        )
    )
    runtime.keep_first_rows()
    return runtime


def _planned(model: Model, optimizer: Optimizer, config: Config, shapes: dict) -> Config:
    """``config`` with "auto" placements resolved, checked against its budgets and the disk before
    init; the shapes of the first units' trees it learnt go into ``shapes`` (by unit index).

    Raises ValueError with the estimate's table when it does not fit
    (``zinf_fn.planner.fit.check_fit``).
    """
    check_model(model, optimizer, config)
    uses_nvme = config.nvme_path is not None
    if config.host_memory_budget is None and config.device_memory_budget is None and not uses_nvme:
        return config

    def built(config_: Config):
        return layout(model, optimizer, config_, shapes, shapes_only=True)

    config = resolve(config, built, model.n_layers)
    check_fit(estimate(built(config), config))
    return config


def init(
    model: Model, optimizer: Optimizer, config: Config | None = None, seed: int = 0
) -> TrainState:
    """Initialise the model one unit at a time, keep this rank's shard of each, write it to its
    tier.

    The whole model is never materialised; the same seed gives the same model at any world size and
    placement.
    """
    runtime = _build(model, optimizer, config, seed)
    # deferred tiles (a mixture's experts) made a few ahead on these threads: tiling.tile_shards
    with ThreadPoolExecutor(MADE_AHEAD, thread_name_prefix="zinf-init") as maker:
        # one unit's tree at a time: the layout step kept only the shapes of the ones it learnt from
        for unit in units(model.n_layers):
            _init_unit(runtime, model, unit, seed, maker)
    return TrainState(model, optimizer, runtime.config, 0, runtime, Lease())


def _init_unit(runtime: Runtime, model: Model, unit: Unit, seed: int, maker: Executor) -> None:
    """``unit``'s initial tree written to its rows, one row at a time."""
    tree = init_unit(model, unit, seed)
    where = f"block.init(gen, {unit.row})" if unit.group == BLOCKS else None
    rows = unit_rows(runtime, unit, tree, where=where, maker=maker)
    del tree
    # lean: each part of the random tree goes before its row's states are written from its
    # copy, and a tile is made only when its row's turn comes (tiling.Deferred)
    for row_unit, part, spec in rows:
        flat = _initial_row(runtime, row_unit, part, spec)
        del part
        if flat is not None:
            runtime.load_row_(row_unit, flat)
        del flat


def unit_rows(
    runtime: Runtime,
    unit: Unit,
    tree: Any,
    where: str | None = None,
    maker: Executor | None = None,
) -> Iterator[tuple[Unit, Any, Any]]:
    """(row unit, its part of ``tree``, its spec) of every row ``unit``'s whole tree fills, in
    order: its group's (tiled nodes and frozen leaves stored apart as anchors), its frozen group's
    (``zinf_fn.formats.frozen``), one per tile, each tile made as it is asked for
    (``tiling.layout.tile_shards``). ``where``: the unit's parts are checked against its group's
    layout (every block's must be block 0's). ``maker``: threads the deferred tiles are made on a
    few ahead (``tile_shards``)."""
    store = runtime.store
    rest, tiled = split_tiled(tree)
    rest, frozen = runtime.frozen.split_tree(unit, rest)
    spec = flat_spec(rest, where=f"{unit.name} init")
    if where is not None:
        runtime.tiles.layout.check(unit.group, tiled, where=where)
        check_same_spec(store.groups[unit.group].spec, spec, where=where)
    out = [(unit, rest, spec)]
    companion = runtime.frozen.companion(unit)
    # the frozen leaves' shapes: the anchors' places were checked with the rest
    if companion is not None:
        # the leaves' shapes (a quantized row's are bytes)
        frozen_spec = runtime.frozen.splits[unit.group].spec
        check_same_spec(
            frozen_spec,
            frozen_spec._replace(
                leaves=tuple(
                    leaf._replace(shape=tuple(x.shape))
                    for leaf, x in zip(frozen_spec.leaves, frozen, strict=True)
                )
            ),
            where or f"{unit.name} init",
        )
        out.append((companion, frozen, frozen_spec))
    return itertools.chain(_popped(out), tile_shards(runtime.tiles.layout, unit, tiled, maker))


def _popped(rows: list) -> Iterator:
    """The items of ``rows``, each taken out of it as it is yielded (consumes ``rows``)."""
    while rows:
        yield rows.pop(0)


def empty_state(
    model: Model, optimizer: Optimizer, config: Config | None = None, step: int = 0
) -> TrainState:
    """A state with every array allocated but unwritten: the target a checkpoint restore fills row
    by row.

    Memory-tier arrays are left uninitialised (no zero-fill pass over the states' memory): the
    caller must write every row this rank holds, padding included, before the state is used.
    """
    runtime = _build(model, optimizer, config, seed=0, zero_fill=False)
    return TrainState(model, optimizer, runtime.config, step, runtime, Lease())


def _initial_row(runtime: Runtime, unit: Unit, tree: Any, spec) -> torch.Tensor | None:
    """The unit's padded flat fp32 row from its initial tree (a quantized frozen row's: its leaves'
    values, ``FrozenCodes.values_numel``); None where another rank owns the unit."""
    if not runtime.sharding.holds(unit):  # broadcast mode: another rank owns this unit
        return None
    padded = runtime.store.groups[unit.group].part.padded_numel
    numel = runtime.frozen.codes.values_numel(unit.group, padded)
    leaves = optree.tree_leaves(tree)
    if len(leaves) == 1 and _is_row(leaves[0], numel):
        # lean: a one-leaf part that fills its row (a tile, an embedding) is the row, not copied
        return leaves[0].reshape(-1)
    flat = torch.zeros(numel, dtype=torch.float32)
    flatten_into_(tree, spec, flat)
    return flat


def _is_row(leaf: Any, numel: int) -> bool:
    """Whether ``leaf`` is already a flat fp32 CPU row of ``numel`` elements (a view, no copy)."""
    return (
        isinstance(leaf, torch.Tensor)
        and leaf.dtype == torch.float32
        and leaf.device.type == "cpu"
        and leaf.is_contiguous()
        and leaf.numel() == numel
    )


def _check_live(state: TrainState, what: str) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(
            f"{what} expects the TrainState returned by zf.init or zf.train_step, got "
            f"{type(state).__name__}"
        )
    if not state.lease.live:
        raise ValueError(
            f"{what}: this TrainState (step {state.step}) was consumed by zf.train_step; its "
            "arrays now hold "
            f"step {state.lease.consumed_at}. Use the state train_step returned: "
            "state, metrics = zf.train_step(state, batch)"
        )


def split_batch(batch: Any, k: int, runtime: Runtime) -> list:
    """Check a batch against the first one seen and split it into k micro-batches along dim 0."""
    leaves, treedef = optree.tree_flatten(batch)
    if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
        raise TypeError(
            f"a batch must be a pytree of tensors, got leaves {[type(x).__name__ for x in leaves]}"
        )
    sizes = {x.shape[0] if x.ndim else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        shapes = [tuple(x.shape) for x in leaves]
        raise ValueError(
            f"every batch leaf needs the same leading (batch) dimension, got shapes {shapes}"
        )
    (n,) = sizes
    if n % k:
        raise ValueError(f"batch size {n} does not divide into grad_accum={k} micro-batches")
    signature = (treedef, tuple((tuple(x.shape[1:]), x.dtype) for x in leaves))
    runtime.first_batch.check(signature)
    leaves = [x.to(runtime.device, non_blocking=True) for x in leaves]
    chunks = [x.chunk(k) for x in leaves]
    return [optree.tree_unflatten(treedef, [c[m] for c in chunks]) for m in range(k)]


def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
    """One optimizer step on ``batch`` (this rank's part). Consumes ``state``; returns (new state,
    metrics)."""
    _check_live(state, "zf.train_step")
    runtime = state.runtime
    micro = split_batch(batch, state.config.grad_accum, runtime)
    state.lease.consume(state.step + 1)  # the arrays are about to change: the old state is spent
    metrics = runtime.train_step(micro, state.step)
    return state._replace(step=state.step + 1, lease=Lease()), metrics


def eval_step(state: TrainState, batch: Any) -> torch.Tensor:
    """The mean loss on ``batch`` (this rank's part, averaged over ranks); changes nothing."""
    _check_live(state, "zf.eval_step")
    return state.runtime.eval_step(split_batch(batch, state.config.grad_accum, state.runtime))


def flush(state: TrainState) -> None:
    """sync: the writes ``train_step`` left in flight are done (raises the first failed write,
    naming its row); call before reading the tier files other than through the engine."""
    _check_live(state, "zf.flush")
    state.runtime.flush()


def close(state: TrainState) -> None:
    """Flush, then stop the state's worker threads and close its tiers (the files stay). The state
    is consumed: it cannot train or save afterwards."""
    _check_live(state, "zf.close")
    state.lease.consume(state.step)
    state.runtime.close()
