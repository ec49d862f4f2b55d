"""The NVMe tier: each state array is a tensorstore zarr3 array on the local file system.

Layout (stable names, so a rerun finds its files)::

    <nvme_path>/<role>/<key>/zarr.json      e.g. <nvme_path>/rank0/optimizer/blocks/master/zarr.json
    <nvme_path>/<role>/<key>/c/<row>/0      one chunk per row: this rank's shard of one layer, raw
                                            little-endian bytes (zarr3 "bytes" codec, no
                                            compression)

so one layer's shard is one contiguous file. The arrays are created, described and readable by
tensorstore (dtype bfloat16 for bf16 rows: the bits of a torch bf16 tensor are the bits of a zarr3
bfloat16); any zarr3 reader opens them.

Two I/O engines move the rows, with identical files:

``"direct"`` (the default): the DeepNVMe-style path of ``zinf_fn.io.direct_files``: I/O threads
  move each chunk file with ``O_DIRECT`` straight from/to the caller's buffer, no intermediate copy;
  the first write of a row creates its file whole (``posix_fallocate``, so ENOSPC raises before a
  byte is written), later writes overwrite it in place.
``"tensorstore"``: tensorstore's own zarr3 driver reads into the caller's buffer through
  ``ts.array(out, copy=False, write=True)`` and writes from a zero-copy view of the source. It is
  the slow twin, and slower on writes: each chunk is copied into a fresh allocation and issued as
  one request (``benchmarks/nvme_bandwidth.py --engine`` compares the two against the raw disk).

``read_``/``write_`` return futures (``.result()`` waits; it raises ``OSError`` naming the layer and
state kind). The caller keeps the buffer alive and untouched until then.

Rows being written are ordered, so a caller may leave writes in flight (the engine's write-behind
does, across the end of a step) and read the rows back at any time: a read of a row whose write is
in flight is served from that write's source buffer (what the disk will hold once it completes;
counted in ``bytes_read`` like every read, and in ``bytes_read_inflight``: the part that skipped the
disk), and a second write of the row waits for the first, so two writes of one row never interleave
on disk. Rows the runtime marks with ``keep`` also stay in memory, written through
(``offload.resident``): their reads skip the disk (``bytes_read_resident``).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import tensorstore as ts
import torch

from ..io import odirect
from ..io.direct_files import DirectFiles
from ..io.files import IO_THREADS, span
from ..io.futures import done, error_code, failed, joined, settle, wrap
from ..layout.units import unit_name
from ..observe.trace import NULL_TRACER, BusyClock
from .inflight_writes import InflightWrites
from .nvme_arrays import ZarrArray, torch_to_numpy, zarr_dtype
from .protocol import NVME_ENGINES
from .resident import ResidentRows

TS_CONCURRENCY = 16  # tensorstore engine: file_io_concurrency and data_copy_concurrency
ENGINES = NVME_ENGINES


def check_nvme_path(nvme_path) -> str:
    """The absolute ``nvme_path``, or a ValueError saying what is wrong with it and how to fix
    it."""
    if not nvme_path:
        raise ValueError("nvme_path is not set; pass zf.Config(nvme_path='/path/to/existing/dir')")
    path = os.path.abspath(os.fspath(nvme_path))
    if not os.path.exists(path):
        raise ValueError(
            f"nvme_path {path!r} does not exist; create it (mkdir -p {path}) or point nvme_path "
            "at an existing directory on the NVMe drive"
        )
    if not os.path.isdir(path):
        raise ValueError(
            f"nvme_path {path!r} is a file, not a directory; point nvme_path at a directory"
        )
    return path


class NvmeTier:
    """State arrays as zarr3 arrays under ``<nvme_path>/<role>``; see the module docstring.

    Eighteen methods, for a reason: the nine of the ``Tier`` protocol (``offload.protocol``),
    ``share`` and ``row_path``; the others are the named steps of a read or a write (a span, a
    tensorstore future, the array asked for, the error naming the row)."""

    def __init__(
        self,
        nvme_path,
        role: str,
        engine: str = "direct",
        threads: int = IO_THREADS,
        tracer=NULL_TRACER,
        clock: BusyClock | None = None,
    ):
        """``tracer`` records every request's span; ``clock`` (the runtime's, shared by every tier)
        counts the time any request of this tier runs."""
        if engine not in ENGINES:
            raise ValueError(f"NvmeTier: engine must be one of {ENGINES}, got {engine!r}")
        self.name = "nvme"
        self.device = torch.device("cpu")
        self.engine = engine
        self.root = os.path.join(check_nvme_path(nvme_path), role)
        self.clock = clock or BusyClock()
        self._files = DirectFiles(
            threads,
            f"zinf-nvme-{role.replace('/', '-')}",
            self._probe(self.root),
            tracer,
            self.clock,
        )
        self._arrays: dict[str, ZarrArray] = {}
        # key -> (tier, key) whose array it is (``share``)
        self._aliases: dict[str, tuple[NvmeTier, str]] = {}
        self._inflight = InflightWrites()
        self._resident = ResidentRows()
        self._context = ts.Context(
            {
                "file_io_concurrency": {"limit": TS_CONCURRENCY},
                "data_copy_concurrency": {"limit": TS_CONCURRENCY},
                "file_io_sync": False,
                "cache_pool": {"total_bytes_limit": 0},
            }
        )
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self.bytes_read_inflight = 0  # of bytes_read: served from the buffer of a write in flight
        self.bytes_read_resident = 0  # of bytes_read: served from a kept row's copy (``keep``)

    @staticmethod
    def _probe(root: str) -> bool:
        """Create ``root``, check it takes a file, and whether it takes O_DIRECT (tmpfs may not)."""
        probe = os.path.join(root, f".probe-{os.getpid()}")
        try:
            os.makedirs(root, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"zinf")
        except OSError as e:
            raise ValueError(
                f"nvme_path: cannot write under {root!r}: {e.strerror or e}; the NVMe tier needs a "
                "writable directory (check permissions, free space and read-only mounts)"
            ) from e
        os.unlink(probe)
        return odirect.write_alignment(root) is not None

    # -- layout
    # --------------------------------------------------------------------------------------
    def allocate(self, key: str, rows: int, numel: int, dtype: torch.dtype) -> None:
        """Open ``key`` if it exists with this shape and dtype (a rerun finds its rows), else create
        it."""
        if key in self._arrays:
            raise ValueError(f"tier 'nvme' ({self.root}): array {key!r} already exists")
        directory = os.path.join(self.root, key)
        metadata = {
            "shape": [rows, numel],
            "data_type": zarr_dtype(dtype),
            "fill_value": 0,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, max(numel, 1)]}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        }
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": directory},
            "metadata": metadata,
        }
        try:
            try:
                handle = ts.open(spec, open=True, create=True, context=self._context).result()
            except ValueError:  # an array from another run with another layout: start it afresh
                handle = ts.open(
                    spec, create=True, delete_existing=True, context=self._context
                ).result()
        except Exception as e:
            raise OSError(
                error_code(e),
                f"NVMe tier: creating array {key!r} ({rows} x {numel} {dtype}) under "
                f"{directory!r} failed: {e}",
            ) from e
        self._arrays[key] = ZarrArray(handle, rows, numel, dtype, directory)

    def drop(self, key: str) -> None:
        """Forget array ``key`` (no I/O of it in flight); its files stay until it is allocated
        again (which may replace them: their open descriptors close here)."""
        arr = self._arrays.pop(key)
        if self._aliases.pop(key, None) is None:
            self._files.forget(arr.directory)

    def share(self, key: str, source: NvmeTier, source_key: str) -> None:
        """Make ``key`` the array ``source_key`` of ``source`` (an fp32 param copy *is* the master):
        its reads and writes are ``source``'s, on ``source``'s files, ordered with ``source``'s
        writes in flight."""
        if key in self._arrays:
            raise ValueError(f"tier 'nvme' ({self.root}): array {key!r} already exists")
        self._arrays[key] = source._arrays[source_key]
        self._aliases[key] = (source, source_key)

    def view(self, key: str, row: int) -> None:
        return None  # no row is a tensor: every access is a read or a write

    def keep(self, key: str, row: int) -> None:
        """Keep a copy of row ``row`` of ``key`` in memory from now on, written through
        (``offload.resident``): once written whole, its reads are served from memory."""
        if key in self._aliases:
            source, source_key = self._aliases[key]
            source.keep(source_key, row)
            return
        arr = self._arrays[key]
        if not 0 <= row < arr.rows:
            raise IndexError(f"tier 'nvme': {key!r} has {arr.rows} rows, got row {row} to keep")
        self._resident.keep(key, row, arr.numel, arr.dtype)

    def keys(self) -> list[str]:
        return list(self._arrays)

    def row_path(self, key: str, row: int) -> str:
        """The file that holds row ``row`` of array ``key`` (its zarr3 chunk), for a caller that
        looks at the files themselves: a benchmark that drops them from the page cache, a test that
        reads the bytes written. Raises ``KeyError`` for an array not allocated."""
        return self._array(key).chunk_path(row)

    def counters(self) -> dict[str, int]:
        """Bytes moved so far; ``bytes_read_inflight`` / ``bytes_read_resident``: the parts of
        ``bytes_read`` served from a write in flight / from a kept row's copy."""
        return {
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "bytes_read_inflight": self.bytes_read_inflight,
            "bytes_read_resident": self.bytes_read_resident,
        }

    def count_view_io(self, read: int = 0, written: int = 0) -> None:
        """No row of this tier is a view (``view`` returns None; a kept row too is served by
        ``read_``), so the engine moves nothing through one; should a caller report such bytes, they
        count as reads and writes."""
        with self._lock:
            self.bytes_read += read
            self.bytes_written += written

    def close(self) -> None:
        self._files.close()

    # -- I/O
    # -----------------------------------------------------------------------------------------
    def read_(self, key: str, row: int, out: torch.Tensor, start: int = 0) -> Future:
        """Copy elements ``[start, start + len(out))`` of row ``row`` of ``key`` (the whole row by
        default) into ``out``, a contiguous CPU tensor of the row's dtype."""
        # a shared array: its source tier moves and counts it
        if (alias := self._aliases.get(key)) is not None:
            return alias[0].read_(alias[1], row, out, start)
        arr = self._checked(key, row, out, start, "read")
        # a kept row: its copy is what the disk holds or will
        if self._resident.read(key, row, start, out):
            with self._lock:
                self.bytes_read += out.numel() * arr.dtype.itemsize
                self.bytes_read_resident += out.numel() * arr.dtype.itemsize
            return done(out)
        # spans being written: what the disk will hold
        left = self._inflight.read_(key, row, start, out)
        from_writes = out.numel() - sum(b - a for a, b in left)
        with self._lock:
            self.bytes_read += out.numel() * arr.dtype.itemsize
            self.bytes_read_inflight += from_writes * arr.dtype.itemsize
        reads = [
            self._read_span(key, row, arr, span(out, a - start, b - start), a) for a, b in left
        ]
        return reads[0] if len(reads) == 1 else joined(reads)

    def _read_span(
        self, key: str, row: int, arr: ZarrArray, out: torch.Tensor, start: int
    ) -> Future:
        describe = lambda: self._what("reading", key, row, arr)
        if self.engine == "tensorstore":
            target = ts.array(torch_to_numpy(out), copy=False, write=True)
            return self._ts_future(
                target.write(arr.handle[row, start : start + out.numel()]), describe, out
            )
        label = ("read", f"read {key}[{row}]")
        return self._files.read(
            arr.chunk_path(row), arr.nbytes, out, describe, label, start * arr.dtype.itemsize
        )

    def write_(self, key: str, row: int, src: torch.Tensor, start: int = 0) -> Future:
        """Copy ``src`` into elements ``[start, start + len(src))`` of row ``row`` of ``key`` (the
        whole row by default); the span changes atomically when the future completes.

        Until then reads of the span are served from ``src``, and a write of an overlapping span
        waits here for this one; writes of disjoint spans of a row run at once.
        """
        # a shared array: its source tier moves and counts it
        if (alias := self._aliases.get(key)) is not None:
            return alias[0].write_(alias[1], row, src, start)
        arr = self._checked(key, row, src, start, "write")
        with self._lock:
            self.bytes_written += src.numel() * arr.dtype.itemsize
        describe = lambda: self._what("writing", key, row, arr)
        entry = self._inflight.begin(key, row, start, src)
        # after begin: in the order the writes reach the disk
        self._resident.write(key, row, start, src)
        try:
            if self.engine == "tensorstore":
                target = arr.handle[row, start : start + src.numel()]
                write = self._ts_future(target.write(torch_to_numpy(src)), describe, src)
            else:
                write = self._files.write(
                    arr.chunk_path(row),
                    arr.nbytes,
                    src,
                    describe,
                    ("write", f"write {key}[{row}]"),
                    start * arr.dtype.itemsize,
                )
        except Exception as e:  # reported through the future, like every I/O error
            write = failed(wrap(e, describe()))
        # a failed write leaves the disk, not the copy, as it was: drop the copy
        if (key, row) in self._resident:
            write.add_done_callback(
                lambda f: f.exception() is None or self._resident.forget(key, row)
            )
        return self._inflight.track(key, row, entry, write)

    def _ts_future(self, future, describe, keepalive) -> Future:
        """A tensorstore future as a ``concurrent.futures.Future`` whose error names the layer and
        state."""
        self.clock.enter()
        out: Future = Future()

        def finished(f, keep=[keepalive]):  # noqa: B006 - holds the buffer until tensorstore is done with it
            self.clock.exit()
            keep.clear()
            settle(out, f, describe)  # tensorstore raises ValueError with the OS message

        future.add_done_callback(finished)
        return out

    def _array(self, key: str) -> ZarrArray:
        """Array ``key``; a ``KeyError`` naming the arrays allocated where there is none."""
        arr = self._arrays.get(key)
        if arr is None:
            raise KeyError(
                f"tier 'nvme' ({self.root}): no array {key!r}; allocated: {sorted(self._arrays)}"
            )
        return arr

    def _checked(self, key: str, row: int, buf: torch.Tensor, start: int, what: str) -> ZarrArray:
        arr = self._array(key)
        if not 0 <= row < arr.rows:
            raise IndexError(f"tier 'nvme': {key!r} has {arr.rows} rows, got row {row}")
        fits = 0 <= start and start + buf.numel() <= arr.numel
        if (
            buf.device.type != "cpu"
            or not buf.is_contiguous()
            or buf.dtype != arr.dtype
            or not fits
        ):
            raise ValueError(
                f"tier 'nvme': {what} of {key!r} row {row} at element {start} needs a contiguous "
                "CPU "
                f"tensor of {arr.dtype} within the row's {arr.numel} elements, got "
                f"{tuple(buf.shape)} "
                f"{buf.dtype} on {buf.device}"
            )
        return arr

    def _what(self, verb: str, key: str, row: int, arr: ZarrArray) -> str:
        group, _, kind = key.partition("/")
        layer = unit_name(group, row)
        return (
            f"NVMe tier {self.root!r}: {verb} layer {layer} state {kind!r} (row {row} of {key!r}, "
            f"{arr.nbytes} bytes) at {arr.chunk_path(row)!r}"
        )
