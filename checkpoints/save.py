"""``save`` and ``save_async``: every rank writes the real part of its shard of every row, in
parallel.

    checkpoints.save("runs/step_100", state, keep=3)            # returns once committed
    handle = checkpoints.save_async("runs/step_200", state)     # returns once the save is set up
    state, metrics = zf.train_step(state, batch)                # training goes on meanwhile
    handle.result()                                             # committed (raises if the save
    failed)

Both are collectives: every rank calls them with the same path. Saving does not consume the state.
Each rank writes ``array[row, lo:hi]``, the real elements it holds of every row it holds
(``rows.py``), of every array (``arrays.py``), from row snapshots (``snapshot.py``), into a hidden
temporary directory; rank 0 commits it with an atomic rename once every rank has reported its part
durable (``commit.py``). The background part coordinates through marker files, not collectives, so
it never interleaves with the training step's collectives.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
import weakref
from queue import Queue

import torch

import zinf_fn as zf
from zinf_fn.io import odirect
from zinf_fn.io.sync import fsync_all
from zinf_fn.state import view

from .arrays import array_spec, io_context, torch_dtype, write_metadata
from .chunkio import ChunkIO, open_slices
from .commit import check_target, commit_, new_save_id, prune, remove_stale, sync_tree, temp_dir
from .links import frozen_groups, link_row, linkable, remember
from .manifest import FORMAT_VERSION, MANIFEST, build_manifest, write_json_, write_manifest_
from .rows import disk_name, held_rows, kind_range
from .snapshot import RowSnapshotter, StagingPool
from .writer import RowWriter

DEFAULT_STAGING_BYTES = 1 << 30  # host RAM for row snapshots per rank (always at least one row)
POLL_S = 0.005

_inflight: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> its SaveHandle
_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> StagingPool (reused)


class SaveHandle:
    """A save in flight. ``result()`` waits for the commit and returns the path (or raises its
    error).

    ``stats``: bytes this rank wrote, ``call_s`` (time save_async blocked its caller), ``guard_s``
    (time training steps waited on this save's write guard), ``guard_copies``, ``seconds`` (the
    whole save on this rank), ``peak_staging_bytes``.
    """

    def __init__(self, path: str, step: int):
        self.path, self.step = path, step
        self.stats: dict = {}
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> str:
        if self._thread is not None:
            self._thread.join(timeout)  # sync: the save is committed (or failed)
            if self._thread.is_alive():
                raise TimeoutError(
                    f"checkpoint save to {self.path!r} still running after {timeout} s"
                )
        if self._error is not None:
            raise RuntimeError(
                f"checkpoint save of step {self.step} to {self.path!r} failed: {self._error}"
            ) from self._error
        return self.path


def save(
    path: str,
    state,
    *,
    keep: int | None = None,
    overwrite: bool = False,
    extra: dict | None = None,
    checksums: bool = True,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    stats: dict | None = None,
) -> str:
    """Write ``state`` to ``path`` and commit it; returns ``path``. See ``save_async`` for the
    arguments; ``stats``, if given, receives what ``SaveHandle.stats`` holds."""
    handle = _start(
        path, state, keep, overwrite, extra, checksums, staging_bytes, training_goes_on=False
    )
    try:
        return handle.result()
    finally:
        if stats is not None:
            stats.update(handle.stats)


def save_async(
    path: str,
    state,
    *,
    keep: int | None = None,
    overwrite: bool = False,
    extra: dict | None = None,
    checksums: bool = True,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> SaveHandle:
    """Start saving ``state`` (not consumed) to ``path``; training may go on while it runs.

    keep           after committing, delete all but the ``keep`` newest checkpoints in ``path``'s
    parent overwrite      replace a complete checkpoint already at ``path`` (refused otherwise)
    extra          JSON-able data stored in the manifest (data-loader position, ...), see
    read_manifest checksums      a crc32c per chunk file (the default), verified on every read: a
    flipped bit
                   becomes a CheckpointError naming the array and row; False writes raw chunks
                   (truncated and missing chunks are detected either way, a flipped bit is not)
    staging_bytes  host RAM per rank for row snapshots; the next steps wait only when it is used up

    The save reflects the state at the moment of the call; later steps cannot tear it (a step copies
    out a row the save has not reached before changing it). One save per state is in flight at a
    time: a second call waits for the first.
    """
    return _start(
        path, state, keep, overwrite, extra, checksums, staging_bytes, training_goes_on=True
    )


def check_live(state, what: str) -> None:
    if not isinstance(state, zf.TrainState):
        raise TypeError(
            f"{what} expects a zf.TrainState (from zf.init or zf.train_step), got "
            f"{type(state).__name__}"
        )
    if not state.lease.live:
        raise ValueError(
            f"{what}: this TrainState (step {state.step}) was consumed by zf.train_step; save the "
            "state train_step returned: state, metrics = zf.train_step(state, batch)"
        )


def _start(
    path, state, keep, overwrite, extra, checksums, staging_bytes, training_goes_on: bool
) -> SaveHandle:
    t0 = time.perf_counter()
    check_live(state, "checkpoints.save")
    store = view(state)
    store.flush()  # sync: the last step's write-behind is on disk (a failed write raises here)
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 (the new checkpoint is always kept), got {keep}")
    engine, comm = store.identity, store.comm
    previous = _inflight.get(engine)
    if previous is not None:
        previous.result()  # sync: one save per state at a time
    path = os.path.abspath(path)
    save_id = _agree(comm, lambda: check_target(path, overwrite), new_save_id)
    tmp = temp_dir(path, save_id)
    manifest = build_manifest(state, save_id, extra, checksums)
    handle = SaveHandle(path, state.step)
    pool = _pools.get(engine)
    if pool is None or pool.budget != staging_bytes:
        pin = torch.cuda.is_available() and any(
            store.device(k).type == "cuda" for k in store.kinds()
        )
        pool = _pools[engine] = StagingPool(
            staging_bytes, pin=pin
        )  # pinned: a GPU row copies out async
    job = SaveJob(state, path, tmp, manifest, keep, pool, training_goes_on, handle)
    handle._thread = threading.Thread(target=job.run, name="zinf-checkpoint", daemon=False)
    _inflight[engine] = handle
    handle._thread.start()
    handle.stats["call_s"] = time.perf_counter() - t0
    return handle


def _agree(comm, check, make):
    """Run ``check`` on every rank; raise everywhere if it raised anywhere; return rank 0's
    ``make()``."""
    error = None
    try:
        check()
    except Exception as e:  # shipped to every rank, re-raised below
        error = e
    gathered = comm.all_gather_object(
        (f"{type(error).__name__}: {error}" if error else None, make() if comm.rank == 0 else None)
    )  # sync: every rank agrees
    if error is not None:
        raise error
    failed = [f"rank {r}: {msg}" for r, (msg, _) in enumerate(gathered) if msg]
    if failed:
        raise RuntimeError("checkpoint save refused on another rank: " + "; ".join(failed))
    return gathered[0][1]


def _prepare(tmp: str, path: str, manifest: dict) -> None:
    """Rank 0: the temporary directory, zarr group metadata and every array's metadata; then
    ``ready``. Nothing is fsynced here: the commit makes the whole tree durable (``sync_tree``)."""
    remove_stale(path)
    os.makedirs(os.path.join(tmp, "_ranks"))
    group_meta = {"zarr_format": 3, "node_type": "group"}
    write_json_(
        os.path.join(tmp, "zarr.json"),
        {
            **group_meta,
            "attributes": {"zinf_fn": {"manifest": MANIFEST, "format_version": FORMAT_VERSION}},
        },
        sync=False,
    )
    for gname in manifest["groups"]:
        os.makedirs(os.path.join(tmp, disk_name(gname)))
        write_json_(
            os.path.join(tmp, disk_name(gname), "zarr.json"),
            {**group_meta, "attributes": {}},
            sync=False,
        )
    for e in manifest["arrays"]:
        write_metadata(
            array_spec(
                os.path.join(tmp, e["name"]),
                *e["shape"],
                torch_dtype(e["dtype"], e["name"]),
                e["chunk_cols"],
                {"zinf_fn": {k: e[k] for k in ("group", "kind", "description")}},
                manifest["checksums"],
            )
        )
    write_json_(
        os.path.join(tmp, "_ranks", "ready"), {}, sync=False
    )  # markers coordinate; they need no fsync


class SaveJob:
    """The background part of one rank's save: snapshot rows, write them, report, (rank 0)
    commit."""

    def __init__(self, state, path, tmp, manifest, keep, pool, training_goes_on, handle):
        self.path, self.tmp, self.manifest, self.keep, self.handle = (
            path,
            tmp,
            manifest,
            keep,
            handle,
        )
        self.store = view(state)
        self.comm = self.store.comm
        self.timeout = state.config.collective_timeout_s
        self.entries = manifest["arrays"]
        self.pool = pool
        self.queue: Queue = Queue()
        kinds = {g: [e["kind"] for e in self.entries if e["group"] == g] for g in self.store.groups}
        stored = self.store.stored_as()
        self.ranges = {
            (e["group"], e["kind"]): kind_range(self.store, stored, e["group"], e["kind"])
            for e in self.entries
        }
        self.link_from, linked = linkable(
            self.store, manifest
        )  # frozen groups: linked from the last save
        order = [(r.group, r.row) for r in held_rows(self.store)]
        self.to_link = [rid for rid in order if rid[0] in linked]
        self.snapshotter = RowSnapshotter(
            self.store,
            kinds,
            [rid for rid in order if rid[0] not in linked],
            pool,
            self.queue,
            views=not training_goes_on,
        )
        self.snapshotter.skip(
            self.to_link
        )  # never changed by a step: nothing for the guard to copy
        self.copy_error: BaseException | None = None
        if training_goes_on:
            self.store.add_save_guard(self.snapshotter.guard)

    def run(self) -> None:
        t0 = time.perf_counter()
        io = None
        try:
            if self.comm.rank == 0:
                _prepare(self.tmp, self.path, self.manifest)
            else:
                self._wait_for(lambda: "ready" in self._markers(), "rank 0 to create the arrays")
            align = odirect.write_alignment(self.tmp)
            io = (
                ChunkIO(align) if align else None
            )  # O_DIRECT chunk files where the file system allows
            nbytes, linked = self._write(io)
            # Every chunk of this rank is durable (io.sync above; tensorstore fsyncs each chunk
            # before its future resolves): the marker only says so.
            write_json_(
                os.path.join(self.tmp, "_ranks", f"rank{self.comm.rank}.done"),
                {"bytes": nbytes},
                sync=False,
            )
            self._commit(io) if self.comm.rank == 0 else self._wait_committed()
            remember(self.store, self.path, self.manifest, frozen_groups(self.store))
            self.handle.stats.update(bytes=nbytes, linked_bytes=linked)
        except BaseException as e:  # handed to result()
            self.handle._error = e
            self.snapshotter.abort.set()
            self._report_failure(e)
        finally:
            if io is not None:
                io.close()
            self._unguard()
            self.pool.wake()
            s = self.snapshotter
            self.handle.stats.update(
                seconds=time.perf_counter() - t0,
                guard_s=s.guard_s,
                guard_copies=s.guard_copies,
                peak_staging_bytes=self.pool.peak,
            )

    def _write(self, io: ChunkIO | None) -> tuple[int, int]:
        """This rank's part of every array: the frozen rows linked, the others copied out and
        written; returns (bytes written, bytes linked), each chunk file and row directory
        durable."""
        context = io_context()
        arrays = {
            (e["group"], e["kind"]): open_slices(
                os.path.join(self.tmp, e["name"]), context, io, write=True
            )
            for e in self.entries
        }
        linked = self._link_frozen(
            io
        )  # before the copier starts: a row that cannot be linked joins it
        copier = threading.Thread(target=self._copy, name="zinf-checkpoint-copy", daemon=True)
        copier.start()
        # Snapshots stay out until written, so staging_bytes bounds the bytes in flight too (views
        # of memory tiers are written with no copy).
        writer = RowWriter(
            arrays,
            self.ranges,
            self.pool,
            self.queue,
            self.snapshotter.abort,
            self.pool.budget,
            lambda: self.copy_error,
        )
        nbytes = writer.write_all(len(self.snapshotter.order))
        if io is not None:
            io.sync()  # sync: every chunk file and row directory of this rank is durable
        copier.join()
        return nbytes, linked

    def _link_frozen(self, io: ChunkIO | None) -> int:
        """Hard-link this rank's chunk files of the frozen rows from the previous checkpoint
        (``links``); a row that cannot be linked is copied and written instead. Returns the bytes
        linked."""
        linked, dirs = 0, []
        for group, row in self.to_link:
            entries = [e for e in self.entries if e["group"] == group]
            spans = {e["kind"]: self.ranges[(group, e["kind"])] for e in entries}
            try:
                dirs += link_row(
                    self.link_from, self.tmp, entries, row, spans, self.manifest["checksums"]
                )
            except OSError:
                self.snapshotter.unskip((group, row))
                continue
            linked += sum(
                (spans[e["kind"]][1] - spans[e["kind"]][0])
                * torch_dtype(e["dtype"], e["name"]).itemsize
                for e in entries
            )
        if io is not None:
            for d in dirs:
                io.written(
                    d
                )  # the links' directory entries become durable with this rank's chunk files
        elif dirs:
            fsync_all(sorted(set(dirs)))  # sync: the links' directory entries are durable
        return linked

    def _copy(self) -> None:
        try:
            self.snapshotter.run_copier()
        except BaseException as e:  # take() set abort; the writer raises this
            self.copy_error = e
        finally:
            self._unguard()  # every row is taken: the next steps need not ask any more

    def _unguard(self) -> None:
        self.store.remove_save_guard(self.snapshotter.guard)

    def _commit(self, io: ChunkIO | None) -> None:
        """Rank 0: wait for every rank's part, write the manifest, rename, apply retention."""
        self._wait_for(lambda: self._ranks_done(), "every rank to finish writing")
        for name in os.listdir(os.path.join(self.tmp, "_ranks")):
            os.remove(os.path.join(self.tmp, "_ranks", name))
        os.rmdir(os.path.join(self.tmp, "_ranks"))
        # The commit record: a crash before the rename below leaves only the hidden temporary
        # directory, so the manifest may become durable together with the rest.
        write_manifest_(self.tmp, self.manifest, sync=False)
        # sync: every file and directory entry under tmp durable (each rank synced its chunk files
        # and row directories; this covers the metadata, the array and ``c`` directories, the
        # manifest)
        sync_tree(self.tmp, skip_chunk_dirs=True, pool=io.pool if io is not None else None)
        commit_(self.tmp, self.path)
        if self.keep is not None:
            prune(os.path.dirname(self.path), self.keep, protect=self.path)

    def _markers(self) -> set[str]:
        """The marker files of this save; raises the first rank's failure if one reported any."""
        try:
            names = set(os.listdir(os.path.join(self.tmp, "_ranks")))
        except FileNotFoundError:
            return set()
        failed = sorted(n for n in names if n.endswith(".failed"))
        if failed:
            try:
                with open(os.path.join(self.tmp, "_ranks", failed[0])) as f:
                    why = f.read()
            except OSError:
                why = "(no details)"
            raise RuntimeError(
                f"{failed[0].removesuffix('.failed')} failed its part of the save: {why}"
            )
        return names

    def _ranks_done(self) -> bool:
        names = self._markers()
        return all(f"rank{r}.done" in names for r in range(self.comm.world_size))

    def _wait_committed(self) -> None:
        """Ranks > 0: the save is done once rank 0's commit of this save id is visible."""

        def committed():
            self._markers()
            try:
                with open(os.path.join(self.path, MANIFEST)) as f:
                    return json.load(f).get("save_id") == self.manifest["save_id"]
            except (FileNotFoundError, ValueError):
                return False

        self._wait_for(committed, "rank 0 to commit")

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint {self.path!r}: waited {self.timeout} s for {what}")
            time.sleep(POLL_S)  # sync: another rank's progress, through marker files

    def _report_failure(self, error: BaseException) -> None:
        try:
            marker = os.path.join(self.tmp, "_ranks", f"rank{self.comm.rank}.failed")
            if os.path.isdir(os.path.dirname(marker)):
                with open(marker, "w") as f:
                    f.write("".join(traceback.format_exception_only(type(error), error)).strip())
        except OSError:
            pass
