"""``restore``: a checkpoint into a fresh TrainState at any world size and placement; resharding is slicing.

Rank r of a world of N holds ``[r * S, (r + 1) * S)`` of each row's padded flat buffer (S the shard size
at N; in "broadcast" mode the whole rows of the units it owns, see ``rows.py``), so it reads
``array[row, lo:hi]`` of every array for the real part of that (the chunks overlapping it, nothing
else) into row ``row`` of its tier arrays; the padding is zero, as at init. Nothing is converted
offline and no collective runs: every rank reads its own slice.

The state is built without a zero-fill pass (every byte it holds is read or zeroed here). Chunk files
are read with O_DIRECT (``chunkio``), bypassing the page cache, in 1 MiB requests through each I/O
thread's reused buffer and then copied into the state's rows, where the file system allows it and the
arrays carry no checksums.
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
from zinf_fn.state import StateView, TrainState, empty_state, view

from .arrays import TORCH_DTYPES, io_context, torch_dtype
from .chunkio import ChunkIO, open_slices
from .manifest import CheckpointError, check_formats, read_manifest
from .rows import element_range, held_rows
from .validate import array_dir, check_chunk_files, check_fits, check_zarr_json

INFLIGHT_BYTES = 256 << 20    # bytes being read at once per rank


def restore(path: str, model, optimizer, config=None, *, stats: dict | None = None) -> TrainState:
    """The TrainState saved at ``path``, laid out for this world size and ``config``'s placements.

    The state has the saved step, so training resumes exactly where it stopped: the same steps give the
    same losses and parameters, bitwise at the same world size. ``optimizer`` supplies the update rule
    and hyper-parameters (they may differ from the saved ones, e.g. a new learning rate); its state
    leaves must match the saved ones. ``config.param_dtype`` may differ: the 16-bit copy is then cast
    from the fp32 master. Raises CheckpointError (and nothing else) for a missing, incomplete, corrupt,
    edited or newer checkpoint, listing every mismatched key path when the model does not fit; nothing
    is returned, the checkpoint is not touched and nothing outside it is read (``validate``).
    ``stats``, if given, receives the bytes this rank read and the seconds spent building and checking
    the empty state (``build_s``), opening the arrays (``open_s``) and reading into it (``read_s``).
    """
    t0 = time.perf_counter()
    manifest = read_manifest(path)   # the schema: every field's type and range, before anything is opened
    state = empty_state(model, optimizer, config, step=manifest["step"])
    check_formats(view(state), "checkpoints.restore")
    check_fits(manifest, view(state), path)   # every field as this model's save would have written it
    t1 = time.perf_counter()
    with opened_arrays(path, manifest) as arrays:
        t2 = time.perf_counter()
        nbytes = _fill_(state, manifest, arrays)
    if stats is not None:
        stats.update(bytes=nbytes, build_s=t1 - t0, open_s=t2 - t1, read_s=time.perf_counter() - t2)
    return state


def reread_(path: str, state: TrainState) -> int:
    """Read the checkpoint at ``path`` again into ``state``'s rows (consumed: overwritten), e.g. the state
    ``restore`` returned from it; returns the bytes read. The read phase of ``restore`` alone, into
    memory that is already resident: the benchmark uses it to tell disk I/O from first-touch faults."""
    manifest = read_manifest(path)
    check_fits(manifest, view(state), path)
    with opened_arrays(path, manifest) as arrays:
        return _fill_(state, manifest, arrays)


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
    """A chunk file of the array with the largest chunks (its row 0 checked to be regular files inside
    the checkpoint; ``open_arrays`` checks the rest): the file the O_DIRECT probe reads; None when the
    checkpoint has none."""
    def chunk_bytes(e):
        return e["chunk_cols"] * TORCH_DTYPES[e["dtype"]].itemsize

    entry = max((e for e in manifest["arrays"] if e["shape"][0] and e["shape"][1]), key=chunk_bytes, default=None)
    if entry is None:
        return None
    directory = array_dir(path, entry)
    check_chunk_files(directory, entry, manifest["checksums"], path, rows=1)
    return os.path.join(directory, "c", "0", "0")


def open_arrays(path: str, manifest: dict, context, io: ChunkIO | None = None) -> dict:
    """Open every array ``manifest`` (read_manifest's, held to the model by ``check_fits``) lists, each
    checked first: inside the checkpoint, its zarr.json as saved, every chunk file there at its size.

    With ``io`` (O_DIRECT works under ``path``) plain arrays read their chunk files themselves
    (``chunkio.ChunkFiles``), and the arrays are opened on its threads, their small metadata reads in
    parallel; the others, and all without ``io``, read through tensorstore.
    """
    def one(entry):
        return (entry["group"], entry["kind"]), _open_array(path, entry, context, io, manifest["checksums"])

    entries = manifest["arrays"]
    return dict(io.pool.map(one, entries) if io is not None else map(one, entries))


def _open_array(path: str, entry: dict, context, io: ChunkIO | None, checksums: bool) -> tuple:
    """One array of a schema-checked manifest, its directory, zarr.json and chunk files checked first
    (``validate``): nothing outside the checkpoint is opened, and nothing is read that is not the size
    the entry implies."""
    where = array_dir(path, entry)
    meta = check_zarr_json(where, entry, checksums, path)
    check_chunk_files(where, entry, checksums, path)
    try:
        array = open_slices(where, context, io, meta=meta)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path!r}: array {entry['name']!r} cannot be opened: {e}") from None
    return array, torch_dtype(entry["dtype"], entry["name"]), f"{path}/{entry['name']}"


def _fill_(state: TrainState, manifest: dict, arrays: dict) -> int:
    """Read this rank's slice of every row it holds into the state's tiers; returns the bytes read."""
    store = view(state)
    reader = SliceReader(store)
    for row in reversed(held_rows(store)):   # scan order: the file order of the blocks' rows
        start, end = element_range(store, row.group)
        for kind in store.kinds(group=row.group):   # a frozen group: its param row only
            source = arrays[(row.group, kind)]
            if kind == "param" and source[1] != store.param_dtype:   # another 16-bit dtype: cast the fp32 master
                source = arrays.get((row.group, "master"), source)   # (a frozen group's copy is all there is)
            reader.submit(source, row.group, row.row, kind, start, end)
    reader.drain()
    return reader.bytes_read


class PendingRead(NamedTuple):
    """A slice being read into row ``row`` of ``kind`` in ``group``: straight into the row's memory
    (``direct``) or into ``buf`` (from the reader's pool), then cast to ``dst_dtype`` and written to the
    tier; ``future`` None for an empty slice; ``label`` names the array in errors."""
    future: Future | None
    buf: torch.Tensor
    direct: bool
    kind: str
    group: str
    row: int
    dst_dtype: torch.dtype
    label: str


def _entry_bytes(entry: PendingRead) -> int:
    return entry.buf.numel() * entry.buf.element_size()


class SliceReader:
    """Reads slices into tier rows with up to INFLIGHT_BYTES in flight: straight into a memory tier's
    row when dtypes agree, else through a reused host buffer (its own ``BufferPool``: at most
    INFLIGHT_BYTES of them out, plus a row's) and ``tier.write_``."""

    def __init__(self, store: StateView):
        self.store = store
        # at most INFLIGHT_BYTES being read (the newest read always runs)
        self.pending: InFlight[PendingRead] = InFlight(self._finish, INFLIGHT_BYTES, weight=_entry_bytes)
        self.bytes_read = 0
        # page-aligned: O_DIRECT reads into them; base pages, as the state's rows (``MemoryTier(zero_fill=False)``)
        self.buffers = BufferPool(limit_per_key=None, pin=False, huge=False)

    def submit(self, source, group: str, row: int, kind: str, start: int, end: int) -> None:
        array, src_dtype, label = source
        dst_dtype, n = self.store.dtype(kind), self.store.shard_numel(group)
        row_view = self.store.view(kind, group, row)
        direct = row_view is not None and row_view.device.type == "cpu" and src_dtype == dst_dtype
        buf = row_view if direct else self.buffers.take(n, src_dtype, "cpu")
        buf[end - start :].zero_()   # the padding, as init leaves it
        future = array.read_into_(row, start, buf[: end - start]) if end > start else None
        self.bytes_read += (end - start) * src_dtype.itemsize
        self.pending.put(PendingRead(future, buf, direct, kind, group, row, dst_dtype, label))   # sync: past the budget

    def drain(self) -> None:
        self.pending.drain()   # sync: every slice is in its tier row

    def _finish(self, entry: PendingRead) -> None:
        if entry.future is not None:
            try:
                entry.future.result()   # sync: the slice is in buf
            except ValueError as e:   # tensorstore: a checksum mismatch, a chunk of the wrong size, ...
                raise CheckpointError(f"checkpoint array {entry.label!r}, row {entry.row}, is corrupt: {e}") from None
        if entry.direct:
            return
        buf = entry.buf
        out = buf if buf.dtype == entry.dst_dtype else self._cast(buf, entry.dst_dtype)
        self.store.write_(entry.kind, entry.group, entry.row, out).result()   # sync: the row is in its tier
        device = self.store.device(entry.kind)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()   # sync: host buffer no longer read
        self.buffers.give_all([buf] if out is buf else [out, buf])

    def _cast(self, buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = self.buffers.take(buf.numel(), dtype, "cpu")
        out.copy_(buf)
        return out
