"""``restore``: a checkpoint into a fresh TrainState at any world size and placement; resharding is
slicing.

Rank r of a world of N holds ``[r * S, (r + 1) * S)`` of each row's padded flat buffer (S the shard
size at N; in "broadcast" mode the whole rows of the units it owns, see ``rows.py``), so it reads
``array[row, lo:hi]`` of every array for the real part of that (the chunks overlapping it, nothing
else) into row ``row`` of its tier arrays; the padding is zero, as at init. Nothing is converted
offline and no collective runs: every rank reads its own slice.

The state is built without a zero-fill pass (every byte it holds is read or zeroed here). Chunk
files are read with O_DIRECT (``chunkio``), bypassing the page cache, a request per chunk file, each
in 1 MiB windows through its I/O thread's reused buffer and then copied into the state's rows (with
checksums, each window added to the chunk's crc32c on the way: ``chunkcrc``), where the file system
allows it.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future
from typing import NamedTuple

import torch

from zinf_fn.io import odirect
from zinf_fn.io.buffers import BufferPool
from zinf_fn.overlap.stream import InFlight
from zinf_fn.state import (
    Row,
    StateView,
    StoredRows,
    TrainState,
    Where,
    check_values,
    empty_state,
    view,
)

from .arrays import TORCH_DTYPES, io_context, torch_dtype
from .chunkio import ChunkIO, open_slices
from .convert import Slot, restore_plan
from .links import frozen_groups, remember
from .manifest import CheckpointError, read_manifest
from .rows import ReadWindow, columns, held_rows, per_element, read_window
from .validate import array_dir, check_chunk_files, check_fits, check_zarr_json

INFLIGHT_BYTES = 256 << 20  # bytes being read at once per rank


def restore(path: str, model, optimizer, config=None, *, stats: dict | None = None) -> TrainState:
    """The TrainState saved at ``path``, laid out for this world size and ``config``'s placements.

    The state has the saved step, so training resumes exactly where it stopped: the same steps give
    the same losses and parameters, bitwise at the same world size. ``optimizer`` supplies the
    update rule and hyper-parameters (they may differ from the saved ones, e.g. a new learning
    rate); its state leaves must match the saved ones. ``config.param_dtype`` may differ: the 16-bit
    copy is then cast from the fp32 master. Raises CheckpointError (and nothing else) for a missing,
    incomplete, corrupt, edited or newer checkpoint, listing every mismatched key path when the
    model does not fit; nothing is returned, the checkpoint is not touched and nothing outside it is
    read (``validate``). ``stats``, if given, receives the bytes this rank read and the seconds
    spent building and checking the empty state (``build_s``), opening the arrays (``open_s``) and
    reading into it (``read_s``).
    """
    t0 = time.perf_counter()
    path = os.fspath(path)  # errors name the path itself, not PosixPath(...)
    manifest = read_manifest(
        path
    )  # the schema: every field's type and range, before anything is opened
    state = empty_state(model, optimizer, config, step=manifest["step"])
    try:
        # every field as this model's save would have written it
        saved = check_fits(manifest, view(state), path, state.optimizer.hyperparams)
        plans = restore_plans(saved, view(state))
        t1 = time.perf_counter()
        with opened_arrays(path, manifest) as arrays:
            t2 = time.perf_counter()
            nbytes = _fill_(state, manifest, arrays, saved, plans)
    except BaseException:
        with contextlib.suppress(Exception):  # the error that matters is the one raised
            view(state).close()  # a state nobody gets keeps no threads or files open
        raise
    as_saved = [
        g for g in frozen_groups(view(state)) if all(slot.convert is None for slot in plans[g])
    ]
    remember(view(state), path, manifest, as_saved)  # a later save may link these groups' arrays
    if stats is not None:
        stats.update(bytes=nbytes, build_s=t1 - t0, open_s=t2 - t1, read_s=time.perf_counter() - t2)
    return state


def reread_(path: str, state: TrainState) -> int:
    """Read the checkpoint at ``path`` again into ``state``'s rows (consumed: overwritten), e.g. the
    state ``restore`` returned from it; returns the bytes read. The read phase of ``restore`` alone,
    into memory that is already resident: the benchmark uses it to tell disk I/O from first-touch
    faults."""
    path = os.fspath(path)
    manifest = read_manifest(path)
    saved = check_fits(manifest, view(state), path, state.optimizer.hyperparams)
    with opened_arrays(path, manifest) as arrays:
        return _fill_(state, manifest, arrays, saved, restore_plans(saved, view(state)))


@contextlib.contextmanager
def opened_arrays(path: str, manifest: dict):
    """``open_arrays`` with O_DIRECT I/O threads where the file system allows it, closed on exit."""
    probe = probe_file(path, manifest)
    align = odirect.read_alignment(probe) if probe is not None else None
    io = ChunkIO(align) if align else None
    try:
        yield open_arrays(path, manifest, io_context(), io)
    finally:
        if io is not None:
            io.close()


def probe_file(path: str, manifest: dict) -> str | None:
    """A chunk file of the array with the largest chunks (its row 0 checked to be regular files
    inside the checkpoint; ``open_arrays`` checks the rest): the file the O_DIRECT probe reads; None
    when the checkpoint has none."""

    def chunk_bytes(e):
        return e["chunk_cols"] * TORCH_DTYPES[e["dtype"]].itemsize

    entry = max(
        (e for e in manifest["arrays"] if e["shape"][0] and e["shape"][1]),
        key=chunk_bytes,
        default=None,
    )
    if entry is None:
        return None
    directory = array_dir(path, entry)
    check_chunk_files(directory, entry, manifest["checksums"], path, rows=1)
    return os.path.join(directory, "c", "0", "0")


def open_arrays(path: str, manifest: dict, context, io: ChunkIO | None = None) -> dict:
    """Open every array ``manifest`` (read_manifest's, held to the model by ``check_fits``) lists,
    each checked first: inside the checkpoint, its zarr.json as saved, every chunk file there at its
    size.

    With ``io`` (O_DIRECT works under ``path``) plain arrays read their chunk files themselves
    (``chunkio.ChunkFiles``), and the arrays are opened on its threads, their small metadata reads
    in parallel; the others, and all without ``io``, read through tensorstore.
    """

    def one(entry):
        return (entry["group"], entry["kind"]), _open_array(
            path, entry, context, io, manifest["checksums"]
        )

    entries = manifest["arrays"]
    return dict(io.pool.map(one, entries) if io is not None else map(one, entries))


def _open_array(path: str, entry: dict, context, io: ChunkIO | None, checksums: bool) -> tuple:
    """One array of a schema-checked manifest, its directory, zarr.json and chunk files checked
    first (``validate``): nothing outside the checkpoint is opened, and nothing is read that is not
    the size the entry implies."""
    where = array_dir(path, entry)
    meta = check_zarr_json(where, entry, checksums, path)
    check_chunk_files(where, entry, checksums, path)
    try:
        array = open_slices(where, context, io, meta=meta)
    except ValueError as e:
        raise CheckpointError(
            f"checkpoint {path!r}: array {entry['name']!r} cannot be opened: {e}"
        ) from None
    return array, torch_dtype(entry["dtype"], entry["name"]), f"{path}/{entry['name']}"


def restore_plans(saved: StoredRows, store: StateView) -> dict[str, list[Slot]]:
    """group -> how each slot of its rows is filled (``convert.restore_plan``)."""
    return {
        g: restore_plan(saved, store.stored_as(), g, store.shares_master(g)) for g in store.groups
    }


def _fill_(state: TrainState, manifest: dict, arrays: dict, saved: StoredRows, plans: dict) -> int:
    """Read this rank's slice of every row it holds into the state's tiers, slot by slot (``plans``:
    as saved, or converted from the checkpoint's formats); returns the bytes read."""
    store = view(state)
    reader = SliceReader(store, saved, arrays, manifest["step"])
    for row in reversed(held_rows(store)):  # scan order: the file order of the blocks' rows
        for slot in plans[row.group]:
            reader.submit(slot, row)
    reader.drain()
    return reader.bytes_read


class PendingRead(NamedTuple):
    """The checkpoint's rows of one slot being read for ``row``: each source kind into
    ``bufs[kind]`` (the state's row itself where it is read straight into a memory row, ``direct``;
    else a buffer of the reader's pool), ``futures`` the slices' reads (None for an empty slice),
    ``spans`` each kind's [lo, hi) in its row, ``window`` the elements read
    (``rows.read_window``)."""

    futures: list[Future | None]
    bufs: dict[str, torch.Tensor]
    direct: frozenset[str]
    spans: dict[str, tuple[int, int]]
    slot: Slot
    row: Row
    window: ReadWindow


def _entry_bytes(entry: PendingRead) -> int:
    return sum(buf.numel() * buf.element_size() for buf in entry.bufs.values())


class SliceReader:
    """Reads slots into tier rows with up to INFLIGHT_BYTES in flight: straight into a memory tier's
    row where the slot is stored alike, else through reused host buffers (its own ``BufferPool``: at
    most INFLIGHT_BYTES of them out, plus a row's), then converted where the formats differ, and
    ``tier.write_``."""

    def __init__(self, store: StateView, saved: StoredRows, arrays: dict, step: int):
        self.store, self.saved, self.arrays, self.step = store, saved, arrays, step
        # at most INFLIGHT_BYTES being read (the newest read always runs)
        self.pending: InFlight[PendingRead] = InFlight(
            self._finish, INFLIGHT_BYTES, weight=_entry_bytes
        )
        self.bytes_read = 0
        # page-aligned: O_DIRECT reads into them; base pages, as the state's rows
        # (``MemoryTier(zero_fill=False)``)
        self.buffers = BufferPool(limit_per_key=None, pin=False, huge=False)

    def submit(self, slot: Slot, row: Row) -> None:
        futures, bufs, direct, spans = [], {}, set(), {}
        per = {kind: per_element(self.saved, kind, row.group) for kind in slot.sources}
        window = read_window(
            self.store, row.group, max(per.values()) if slot.convert is not None else 1
        )
        for kind in slot.sources:
            array, dtype, _ = self.arrays[(row.group, kind)]
            view = self.store.view(kind, row.group, row.row) if slot.convert is None else None
            if view is not None and view.device.type == "cpu":
                bufs[kind] = view
                direct.add(kind)
            else:
                bufs[kind] = self.buffers.take(window.numel // per[kind], dtype, "cpu")
            lo, hi = spans[kind] = columns(window, per[kind])
            bufs[kind][hi - lo :].fill_(
                slot.source_format.zero_value(kind)
            )  # the padding, as init leaves it
            futures.append(
                array.read_into_(row.row, lo, bufs[kind][: hi - lo]) if hi > lo else None
            )
            self.bytes_read += (hi - lo) * dtype.itemsize
        self.pending.put(
            PendingRead(futures, bufs, frozenset(direct), spans, slot, row, window)
        )  # sync: budget

    def drain(self) -> None:
        self.pending.drain()  # sync: every slice is in its tier row

    def _finish(self, entry: PendingRead) -> None:
        row = entry.row
        for kind, future in zip(entry.slot.sources, entry.futures, strict=True):
            label = self.arrays[(row.group, kind)][2]
            if future is not None:
                try:
                    future.result()  # sync: the slice is in its buffer
                except (
                    ValueError
                ) as e:  # tensorstore: a checksum mismatch, a chunk of the wrong size, ...
                    raise CheckpointError(
                        f"checkpoint array {label!r}, row {row.row}, is corrupt: {e}"
                    ) from None
            lo, hi = entry.spans[kind]
            _check_values(kind, entry.bufs[kind][: hi - lo], label, row.row, lo)
        if entry.slot.convert is None:
            out = {k: b for k, b in entry.bufs.items() if k not in entry.direct}
        else:
            window = entry.window
            where = Where(
                row.unit.index, self.step - 1, window.start + window.keep.start
            )  # the shard's first
            out = entry.slot.convert(entry.bufs, where, window.keep)
        for kind, tensor in out.items():
            self.store.write_(
                kind, row.group, row.row, tensor
            ).result()  # sync: the row is in its tier
            device = self.store.device(kind)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # sync: host buffer no longer read
        self.buffers.give_all([b for k, b in entry.bufs.items() if k not in entry.direct])


def _check_values(kind: str, values: torch.Tensor, label: str, row: int, lo: int) -> None:
    """CheckpointError naming the array, row and element where ``values`` (elements [lo, ...) of the
    row) hold what no save writes (``zinf_fn.state.check_values``: an int8 scale NaN, infinite or
    negative)."""
    bad = check_values(kind, values)
    if bad is not None:
        i, expected = bad
        raise CheckpointError(
            f"checkpoint array {label!r}, row {row}, element {lo + i}: expected {expected}, "
            f"got {float(values[i])!r}"
        )
