"""The public engine: ``init``, ``train_step``, ``eval_step`` over an explicit ``TrainState``.

``train_step`` consumes the state it is given (the tier arrays are updated in place, like JAX's
donated arguments) and returns the new one; using the consumed state again raises.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import optree
import torch

from .config import Config, spill_of
from .io.heap import fix_mmap_threshold
from .memory import check_fit, estimate, resolve
from .model import Model, check_ties
from .offload.spill import SpillTier
from .offload.tiers import MetaTier, can_share, make_tier
from .optim.optimizers import Optimizer
from .partition.comm import current_comm
from .partition.fingerprint import check_agreement, fingerprint
from .partition.sharding import make_sharding
from .runtime import Runtime
from .store import Group, Split, Store
from .tiling.layout import add_tile_groups, split, tile_shards
from .trace import make_observers
from .tree import check_same_spec, flat_spec, flatten_into_
from .units import BLOCKS, EMBED, HEAD, Unit, head_index, stage_rows, units


class Lease:
    """Who may use the tier arrays: exactly one live TrainState at a time."""

    def __init__(self):
        self.live = True
        self.consumed_at: int | None = None


class TrainState(NamedTuple):
    model: Model
    optimizer: Optimizer
    config: Config
    step: int
    runtime: Runtime
    lease: Lease


def unit_generator(seed: int, unit: Unit) -> torch.Generator:
    """The generator a unit is initialised from: depends on the seed and unit only (not rank, not placement)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + unit.index)


def init_unit(model: Model, unit: Unit, seed: int) -> Any:
    gen = unit_generator(seed, unit)
    if unit.group == EMBED:
        return model.embed.init(gen)
    if unit.group == HEAD:
        return model.head.init(gen)
    return model.block.init(gen, unit.row)


def _check_model(model: Model, optimizer: Optimizer, config: Config) -> None:
    if not isinstance(model, Model):
        raise TypeError(f"zf.init expects a zf.Model, got {type(model).__name__}")
    if not isinstance(model.n_layers, int) or model.n_layers < 1:
        raise ValueError(f"zf.Model.n_layers must be an int >= 1, got {model.n_layers!r}")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"zf.init expects an optimizer from zf.adamw / zf.sgd, got {type(optimizer).__name__}")
    if not isinstance(config, Config):
        raise TypeError(f"zf.init expects a zf.Config, got {type(config).__name__}")


def _build(model: Model, optimizer: Optimizer, config: Config | None, seed: int,
           zero_fill: bool = True, meta: dict | None = None) -> tuple[Runtime, dict]:
    """The runtime with every array allocated (not yet written), and the trees made to learn the layout.

    ``zero_fill=False`` leaves memory-tier arrays uninitialised: only for a caller that writes every byte.
    ``meta``: a layout build (``layout``): every tier an ``offload.tiers.MetaTier`` that allocates nothing,
    the first unit's trees of each group taken from / kept in ``meta``, no agreement exchange.
    """
    config = config or Config()
    _check_model(model, optimizer, config)
    if meta is None:
        config = _planned(model, optimizer, config)
    comm = current_comm(config.collective_timeout_s)
    sharding = make_sharding(config.partition, comm, model.n_layers)
    device = config.resolved_device()

    observers = make_observers(config.trace if meta is None else None)
    if meta is None:   # a real state (a layout build, e.g. zf.estimate's, leaves malloc alone)
        fix_mmap_threshold(config.resolved_mmap_threshold())

    def made(placement: str, role: str):
        if meta is not None:
            return MetaTier(placement, device if placement == "none" else torch.device("cpu"))
        return make_tier(placement, device, config.nvme_path, f"rank{comm.rank}/{role}", zero_fill,
                         observers.tracer, observers.io_clock, config.nvme_engine)

    splits = {kind: split_of(config, kind) for kind in ("params", "optimizer")}

    def tier(kind: str, role: str):
        split = splits[kind]   # its placement, and where its units from first_spilled on go: zinf_fn.offload.spill
        fast = made(split.fast, role)
        return sharding.wrap_tier(fast if split.slow is None else
                                  SpillTier(fast, made(split.slow, role), split, model.n_layers))

    param_tier, opt_tier = tier("params", "params"), tier("optimizer", "optimizer")
    shared = can_share(param_tier, opt_tier, config.param_dtype)   # an fp32 param copy beside its master
    store = Store(param_tier, opt_tier, config.param_dtype, splits,
                  (lambda param, master: param_tier.share(param, opt_tier, master)) if shared else None)
    runtime = Runtime(model, optimizer, config, store, sharding, observers)
    all_units = units(model.n_layers)
    firsts = {u.group: u for u in reversed(all_units)}   # the first unit of each group
    trees = {}
    for group, unit in sorted(firsts.items(), key=lambda kv: kv[1].index):
        trees[unit.index] = init_unit(model, unit, seed) if meta is None or unit.index not in meta \
            else meta[unit.index]
        rest, tiled = split(trees[unit.index])   # tiled leaves become groups of their own (zinf_fn.tiling.layout)
        spec = flat_spec(rest, where=f"{unit.name} init")
        part = sharding.partition(spec.numel)
        n_opt = len(optimizer.init(torch.zeros(1)))   # the leaf count (init is elementwise): no layer of zeros
        rows = stage_rows(group, model.n_layers)
        store.add_group(Group(group, rows, spec, part), n_opt, config.clip_grad_norm is not None)
        leaves = runtime.tiles.layout.register(group, tiled, model.n_layers, where=f"{unit.name} init")
        add_tile_groups(store, leaves, runtime.tiles.layout, sharding, all_units, n_opt,
                        config.clip_grad_norm is not None)
    check_ties(model, trees[0], trees[head_index(model.n_layers)])
    if meta is not None:
        meta.update(trees)
        return runtime, trees
    # sync: the one exchange before any training collective; a mismatch raises on every rank
    check_agreement(comm.all_gather_object(fingerprint(store.groups.values(), model.n_layers, config, optimizer,
                                                       seed)))
    runtime.keep_first_rows()
    return runtime, trees


def split_of(config: Config, kind: str) -> Split:
    """``config``'s ``Split`` of ``kind`` ("params" or "optimizer"): ``offload_<kind>`` and ``spill_<kind>``."""
    spill = spill_of(config, kind)   # (first spilled unit, its placement) or None
    placement = getattr(config, f"offload_{kind}")
    return Split(placement) if spill is None else Split(placement, spill[1], spill[0])


def layout(model: Model, optimizer: Optimizer, config: Config, trees: dict | None = None):
    """The store ``zf.init`` would build for ``config``, its tiers ``MetaTier``s: shapes only, nothing
    allocated but the first unit of each group (initialised to learn its layout, kept in ``trees``)."""
    runtime, _ = _build(model, optimizer, dataclasses.replace(config, offload_activations="none"), 0,
                        meta={} if trees is None else trees)
    runtime.close()
    return runtime.store


def _planned(model: Model, optimizer: Optimizer, config: Config) -> Config:
    """``config`` with "auto" placements resolved, checked against its budgets and the disk before init.

    Raises ValueError with the estimate's table when it does not fit (``zinf_fn.memory.check_fit``).
    """
    uses_nvme = config.nvme_path is not None
    if config.host_memory_budget is None and config.device_memory_budget is None and not uses_nvme:
        return config
    trees: dict = {}
    config = resolve(config, lambda c: layout(model, optimizer, c, trees), model.n_layers)
    check_fit(estimate(layout(model, optimizer, config, trees), config, model.n_layers))
    return config


def init(model: Model, optimizer: Optimizer, config: Config | None = None, seed: int = 0) -> TrainState:
    """Initialise the model one unit at a time, keep this rank's shard of each, write it to its tier.

    The whole model is never materialised; the same seed gives the same model at any world size and
    placement.
    """
    runtime, trees = _build(model, optimizer, config, seed)
    # The trees _build made of the units written first (embed, block 0) are reused; the head's would be
    # held through every block's write, so it is made again when its turn comes.
    trees = {i: tree for i, tree in trees.items() if i <= 1}
    block_spec = runtime.store.groups[BLOCKS].spec
    for unit in units(model.n_layers):
        tree = trees.pop(unit.index) if unit.index in trees else init_unit(model, unit, seed)
        tree, tiled = split(tree)
        spec = flat_spec(tree, where=f"{unit.name} init")
        if unit.group == BLOCKS:
            runtime.tiles.layout.check(BLOCKS, tiled, where=f"block.init(gen, {unit.row})")
            check_same_spec(block_spec, spec, where=f"block.init(gen, {unit.row})")
        flat = _initial_row(runtime, unit, tree, spec)
        del tree   # lean: the random tree goes before the row's states are written from its flat copy
        if flat is not None:
            runtime.load_row_(unit, flat)
        del flat
        for tile_unit, tile, tile_spec in tile_shards(runtime.tiles.layout, unit, tiled):
            flat = _initial_row(runtime, tile_unit, tile, tile_spec)
            if flat is not None:
                runtime.load_row_(tile_unit, flat)
            del flat
    return TrainState(model, optimizer, runtime.config, 0, runtime, Lease())


def empty_state(model: Model, optimizer: Optimizer, config: Config | None = None, step: int = 0) -> TrainState:
    """A state with every array allocated but unwritten: the target a checkpoint restore fills row by row.

    Memory-tier arrays are left uninitialised (no zero-fill pass over the states' memory): the caller
    must write every row this rank holds, padding included, before the state is used.
    """
    runtime, _ = _build(model, optimizer, config, seed=0, zero_fill=False)
    return TrainState(model, optimizer, runtime.config, step, runtime, Lease())


def _initial_row(runtime: Runtime, unit: Unit, tree: Any, spec) -> torch.Tensor | None:
    """The unit's padded flat fp32 row from its initial tree; None where another rank owns the unit."""
    if not runtime.sharding.holds(unit):   # broadcast mode: another rank owns this unit
        return None
    flat = torch.zeros(runtime.store.groups[unit.group].part.padded_numel, dtype=torch.float32)
    flatten_into_(tree, spec, flat)
    return flat


def _check_live(state: TrainState, what: str) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(
            f"{what} expects the TrainState returned by zf.init or zf.train_step, got {type(state).__name__}"
        )
    if not state.lease.live:
        raise ValueError(
            f"{what}: this TrainState (step {state.step}) was consumed by zf.train_step; its arrays now hold "
            f"step {state.lease.consumed_at}. Use the state train_step returned: "
            "state, metrics = zf.train_step(state, batch)"
        )


def split_batch(batch: Any, k: int, runtime: Runtime) -> list:
    """Check a batch against the first one seen and split it into k micro-batches along dim 0."""
    leaves, treedef = optree.tree_flatten(batch)
    if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
        raise TypeError(f"a batch must be a pytree of tensors, got leaves {[type(x).__name__ for x in leaves]}")
    sizes = {x.shape[0] if x.ndim else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        shapes = [tuple(x.shape) for x in leaves]
        raise ValueError(f"every batch leaf needs the same leading (batch) dimension, got shapes {shapes}")
    (n,) = sizes
    if n % k:
        raise ValueError(f"batch size {n} does not divide into grad_accum={k} micro-batches")
    signature = (treedef, tuple((tuple(x.shape[1:]), x.dtype) for x in leaves))
    if runtime.batch_signature is None:
        runtime.batch_signature = signature
    elif signature != runtime.batch_signature:
        want = [f"(B, {', '.join(map(str, s))}) {d}" for s, d in runtime.batch_signature[1]]
        got = [f"(B, {', '.join(map(str, s))}) {d}" for s, d in signature[1]]
        raise ValueError(f"batch differs from the first batch of this run: expected leaves {want}, got {got}")
    leaves = [x.to(runtime.device, non_blocking=True) for x in leaves]
    chunks = [x.chunk(k) for x in leaves]
    return [optree.tree_unflatten(treedef, [c[m] for c in chunks]) for m in range(k)]


def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
    """One optimizer step on ``batch`` (this rank's part). Consumes ``state``; returns (new state, metrics)."""
    _check_live(state, "zf.train_step")
    runtime = state.runtime
    micro = split_batch(batch, state.config.grad_accum, runtime)
    state.lease.live = False   # the arrays are about to change: the old state is consumed from here on
    state.lease.consumed_at = state.step + 1
    metrics = runtime.train_step(micro, state.step)
    return state._replace(step=state.step + 1, lease=Lease()), metrics


def eval_step(state: TrainState, batch: Any) -> torch.Tensor:
    """The mean loss on ``batch`` (this rank's part, averaged over ranks); changes nothing."""
    _check_live(state, "zf.eval_step")
    return state.runtime.eval_step(split_batch(batch, state.config.grad_accum, state.runtime))


def flush(state: TrainState) -> None:
    """sync: the writes ``train_step`` left in flight are done (raises the first failed write, naming its
    row); call before reading the tier files other than through the engine."""
    _check_live(state, "zf.flush")
    state.runtime.flush()


def close(state: TrainState) -> None:
    """Flush, then stop the state's worker threads and close its tiers (the files stay). The state is
    consumed: it cannot train or save afterwards."""
    _check_live(state, "zf.close")
    state.lease.live = False
    state.lease.consumed_at = state.step
    state.runtime.close()
