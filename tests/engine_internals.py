"""The one place the tests reach past ``zinf_fn.state`` into a state's engine
(``TrainState.runtime``).

Everything a test *reads* goes through the public state interface (``zinf_fn.state.view(state)``:
rows, ``counters()``, ``state_bytes()``, ...). What is here has no public seam, on purpose:

- gates and logs that *wrap* an engine object of one state (the write-behind's waits, the fetcher,
  the gradient scatter, the optimizer's buffer pool), to hold I/O until the engine waits for it or
  to record the order of events in a step (and the fetcher's kept tiles: ``log_tile_fetches``,
  ``most_held_rows``), and one switch of the composition root
  (``keep_no_rows_resident``). The engine offers no hooks (STYLE habit 15: nothing is patched after
  construction), so a test that needs one patches that one object here, through ``monkeypatch``
  where it outlives the call;
- the arrays a tier *allocated* (``allocated_arrays``): the tiers record no shapes behind their
  Protocol, and the memory contract's tests compare what init allocated with what the planner
  predicted;
- the private parts a unit test of one part looks at: a tape's kept tensors (``tape_tensors``),
  the collectives a ``DistComm`` picked (``collective_picks``), the restore's check of a slice
  (``restore_value_check``), and the file layer's writes gated or logged (``wrap_pwrite``,
  ``log_file_writes``).

When an engine internal is renamed, this file is the one test file to follow it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import NamedTuple

from zinf_fn.io import files as direct_io
from zinf_fn.offload.nvme import NvmeTier
from zinf_fn.planner.memory import members
from zinf_fn.runtime import Runtime
from zinf_fn.tiling.layout import TileUnit


def _runtime(state):
    return state.runtime


def open_on_drain(monkeypatch, state, gate) -> None:
    """Open ``gate`` when the engine first waits for its write-behind: to finish (``drain``), or to
    be back to ``prefetch_depth`` pieces before the next pass's reads (``press``)."""
    writes = _runtime(state).updater.writes
    drain, press = writes.drain, writes.press
    monkeypatch.setattr(writes, "drain", lambda: (gate.open(), drain())[1])
    monkeypatch.setattr(writes, "press", lambda room=None: (gate.open(), press(room))[1])


def keep_no_rows_resident(monkeypatch) -> None:
    """States made from here on keep no 16-bit row in memory (``Runtime.keep_first_rows`` off), as
    for rows too large to keep: a step's first reads then go to the tier (or its writes in
    flight)."""
    monkeypatch.setattr(Runtime, "keep_first_rows", lambda self: None)


def log_fetches(state, log: list, grads: bool = False) -> None:
    """Append ``("fetch", unit)`` to ``log`` each time ``state``'s engine fetches a unit or tile
    and, with ``grads``, ``("grad", unit)`` each time it hands a gradient to the reduce-scatter."""
    runtime = _runtime(state)
    fetch, scatter = runtime.fetcher.fetch, runtime.updater.scatter
    runtime.fetcher.fetch = lambda unit, *started: (
        log.append(("fetch", unit)),
        fetch(unit, *started),
    )[1]
    if grads:
        runtime.updater.scatter = lambda unit, flat, *rest: (
            log.append(("grad", unit)),
            scatter(unit, flat, *rest),
        )[1]


def log_tile_fetches(state, log: list) -> None:
    """Append ``(tile, made)`` to ``log`` for each tile ``state``'s fetcher hands out: ``made``
    False where it handed out a layer it holds instead of making one (a tile a training step kept
    from its forward into its backward, ``tiling.keep``: nothing read)."""
    fetcher = _runtime(state).fetcher
    fetch = fetcher.fetch

    def logged(unit, *started):
        layer = fetch(unit, *started)
        if isinstance(unit, TileUnit):
            log.append((unit, layer.owned))
        return layer

    fetcher.fetch = logged


def most_held_rows(state, groups) -> dict[str, int]:
    """Per group of ``groups``: the most of its rows ``state``'s fetcher held at once, counted
    after each release from here on (a training step's kept tiles, ``tiling.keep``, are held so);
    the returned dict is updated in place."""
    fetcher = _runtime(state).fetcher
    release = fetcher.release
    most = dict.fromkeys(groups, 0)

    def counted(layer, keep=False):
        release(layer, keep)
        for group in most:
            most[group] = max(most[group], sum(1 for g, _ in fetcher._held if g == group))

    fetcher.release = counted
    return most


def wrap_optimizer_pool(state, wrap: Callable):
    """Give the optimizer's read-ahead, updates and write-behind ``wrap(pool)`` instead of the
    engine's buffer pool (to count what they hold); returns the wrapper."""
    updater = _runtime(state).updater
    wrapped = wrap(updater.pool)
    for part in (
        updater,
        updater.gradients,
        updater.cast,
        updater.reads,
        updater.writes,
        updater.strategies.streamed,
    ):
        part.pool = wrapped
    return wrapped


class Array(NamedTuple):
    tier: str  # the member tier's placement ("cpu", "nvme", ...)
    key: str  # "<group>/<kind>"
    numel: int  # elements allocated (every row this rank stores)
    nbytes: int
    ident: object  # the same for a param array that *is* the master array


def allocated_arrays(state, role: str | None = None) -> list[Array]:
    """Every array the tiers of ``state`` allocated on this rank (``role``: "param" or "optimizer"
    only), over the members of a split tier, rows of other ranks (broadcast mode) not allocated."""
    store = _runtime(state).store
    tiers = {"param": [store.param_tier], "optimizer": [store.opt_tier]}.get(
        role, [store.opt_tier, store.param_tier]
    )
    out = []
    for tier in [m for t in tiers for m in members(t)]:
        for name, arr in tier._arrays.items():
            if isinstance(tier, NvmeTier):
                numel, ident = arr.rows * arr.numel, (tier.root, name)
                nbytes = numel * arr.dtype.itemsize
            else:
                numel, nbytes, ident = arr.numel(), arr.numel() * arr.element_size(), arr.data_ptr()
            out.append(Array(tier.name, name, numel, nbytes, ident))
    return out


def allocated(state) -> dict:
    """(placement, kind) -> bytes of the arrays the init'd state's store holds (shared arrays
    once)."""
    out, seen = collections.Counter(), set()
    for array in allocated_arrays(
        state
    ):  # the optimizer's arrays first: a shared array is the master
        if array.ident in seen:  # an fp32 param array that *is* the master
            continue
        seen.add(array.ident)
        out[(array.tier, array.key.split("/")[1].split(".")[0])] += array.nbytes
    return dict(out)


def tier_of(state, kind: str):
    """The tier object holding ``kind`` (a ``SpillTier``'s members and row split have no public
    view: only the spillover test looks at them)."""
    return _runtime(state).store.tier_of(kind)


def tape_tensors(tape) -> tuple[list, list]:
    """(the inputs, the graph's outputs) a recorded ``scan.tape.Tape`` keeps until pulled back."""
    return list(tape._flat_inputs()), list(tape._graph_outputs)


def collective_picks(comm) -> tuple[str, str]:
    """The names of the allgather and reduce-scatter a ``partition.comm.DistComm`` picked."""
    return comm._gather.__name__, comm._scatter.__name__


def restore_value_check() -> Callable:
    """The check every slice of a restore passes (``checkpoints.restore``): ``check(kind, values,
    label, row, lo)`` raises ``CheckpointError`` for a value the engine would refuse."""
    import sys

    return sys.modules["checkpoints.restore"]._check_values


def wrap_pwrite(monkeypatch, wrap: Callable) -> None:
    """Every whole write of the O_DIRECT file layer goes through ``wrap(real)(fd, mem, offset)``,
    where ``real`` is the layer's own (``io.files``): to hold or fail writes of chosen files."""
    monkeypatch.setattr(direct_io, "_pwrite_full", wrap(direct_io._pwrite_full))


def log_file_writes(monkeypatch, tier: NvmeTier, issued: list) -> None:
    """Append the first argument of each write ``tier`` hands its file layer to ``issued``."""
    real_write = tier._files.write

    def write(*args):
        issued.append(args[0])
        return real_write(*args)

    monkeypatch.setattr(tier._files, "write", write)
