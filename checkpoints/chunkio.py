"""Moving slices of checkpoint arrays: chunk files read and written with O_DIRECT, or through
tensorstore.

A checkpoint array with the plain ``bytes`` codec stores chunk ``(row, c)`` of shape ``(1, cols)``
as the file ``<array>/c/<row>/<c>``: exactly ``cols * itemsize`` raw little-endian bytes (the chunk
at the row's end is full size too, zero past the last element), followed, with checksums (zarr v3's
``crc32c`` codec, the default), by the crc32c of those bytes as a little-endian uint32.
``ChunkFiles`` reads and writes those files itself, several requests in flight on ``ChunkIO``'s
threads, through the engine's file layer (``zinf_fn.io.files``): a write is one request per chunk
file, which ``files.create`` makes (allocated whole: zeros past the data, ENOSPC before a byte is
written) and ``files.write_span`` fills (O_DIRECT straight from the tensor where it is aligned, the
rest through the page cache); a read is one request per ``READ_PIECE_BYTES`` of a file
(``benchmarks/checkpoint_choices.py`` compares the choices), O_DIRECT through the thread's reused
staging buffer, 1 MiB at a time, each window copied into the destination (``STAGE_READS``,
``files.read_staged_``), or ``files.read_span_`` where the file system takes no O_DIRECT. With
checksums (``chunkcrc``) a save computes each chunk's crc32c on threads of its own
(``CRC_THREADS``) while an I/O thread writes the bytes, which then writes the crc32c after them;
a read is one request per chunk file, read whole through the staging windows, each window added
to the crc32c while in the cache, which is compared with the stored one (from the last window)
before the read resolves. The files are the ones tensorstore writes and reads (tests compare both
ways, bitwise). ``TsSlices`` is the tensorstore twin, used where O_DIRECT is refused or the codec
chain is another.

Durability on save: a write's future resolves once its bytes are written (the source may then be
reused); ``ChunkIO.sync`` then makes every chunk file written and its row directory ``c/<row>``
durable at once, with one ``syncfs`` (``zinf_fn.io.sync``) or, without it, concurrent fsyncs; the
commit's ``sync_tree`` covers every other file and directory.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zinf_fn.io import files, odirect
from zinf_fn.io.files import IO_THREADS, FileIO
from zinf_fn.io.futures import failed
from zinf_fn.io.sync import fsync_all, syncfs

from .arrays import (
    CRC32C_CODECS,
    PLAIN_CODECS,
    TORCH_DTYPES,
    ZARR_JSON_BYTES,
    chunk_file_bytes,
    open_array,
    read_into_,
    torch_dtype,
    write_from,
)
from .chunkcrc import CheckedRead, SealedWrite
from .schema import load_json

STAGE_BYTES = (
    files.STAGE_BYTES
)  # staging window per I/O thread (a multiple of every O_DIRECT alignment)
READ_PIECE_BYTES = 16 << 20  # one read request at most (a multiple of every O_DIRECT alignment)
# Reads go through the I/O thread's reused staging buffer (``STAGE_BYTES`` windows, each copied into
# the destination): on the VM of issue 22 the disk filled a reused, cache-resident 1 MiB buffer
# ~1.3x faster than the state's own rows (memory the size of the data, resident or fresh), which the
# copy out of the buffer more than pays for (~0.1 s of CPU per 360 MB; BENCHMARKS.md,
# ``benchmarks/checkpoint_choices.py``). False reads straight into the destination where it and the
# file offset are aligned (no copy; the choice before, which takes the least CPU).
STAGE_READS = True
# Threads computing a save's crc32c (the crc32c package releases the GIL; one runs ~10 GB/s, several
# times the disk's speed): the I/O threads only write, the crc runs beside them.
CRC_THREADS = 2


class ChunkIO(FileIO):
    """The I/O threads of one save or restore (the engine's ``FileIO``: each thread with its own
    reused page-aligned staging buffer); ``align``: the file system's O_DIRECT alignment
    (``odirect.read_alignment`` / ``write_alignment``); ``stage_reads``: read through the staging
    buffer even where the destination is aligned."""

    def __init__(self, align: int, threads: int = IO_THREADS, stage_reads: bool | None = None):
        super().__init__(threads, "zinf-ckpt-io")
        # a save's crc32c of each chunk (chunkcrc.SealedWrite), beside the I/O threads' writes
        self.crc_pool = ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="zinf-ckpt-crc")
        self.align = align
        self.stage_reads = STAGE_READS if stage_reads is None else stage_reads
        self._unsynced: list[str] = []  # files and directories written, not yet fsynced
        self._lock = threading.Lock()

    def written(self, path: str) -> None:
        with self._lock:
            self._unsynced.append(path)

    def close(self) -> None:
        super().close()
        self.crc_pool.shutdown(wait=True)

    def sync(self) -> None:
        """Every file and directory registered with ``written`` durable on return: one ``syncfs`` of
        their file system where the OS has it, else an fsync of each, in parallel."""
        with self._lock:
            paths, self._unsynced = list(dict.fromkeys(self._unsynced)), []
        if paths and not syncfs(paths[0]):
            fsync_all(paths, self.pool)


def plain_layout(directory: str, meta: dict | None = None) -> dict | None:
    """The array's zarr.json if its chunks are plain ``(1, cols)`` raw little-endian files (with or
    without a crc32c after the bytes), else None; ``meta``: that zarr.json already read (a
    restore's, checked by ``validate``), else it is read here."""
    try:
        meta = (
            load_json(os.path.join(directory, "zarr.json"), ZARR_JSON_BYTES)
            if meta is None
            else meta
        )
        grid = meta["chunk_grid"]
        key_encoding = meta["chunk_key_encoding"]
        plain = (
            meta.get("zarr_format") == 3
            and meta.get("node_type") == "array"
            and len(meta["shape"]) == 2
            and grid["name"] == "regular"
            and grid["configuration"]["chunk_shape"][0] == 1
            and key_encoding["name"] == "default"
            and key_encoding.get("configuration", {}).get("separator", "/") == "/"
            and meta["codecs"] in (PLAIN_CODECS, CRC32C_CODECS)
            and meta["fill_value"] == 0
            and meta["data_type"] in TORCH_DTYPES
            and not meta.get("storage_transformers")
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    return meta if plain else None


def open_slices(
    directory: str, context, io: ChunkIO | None, write: bool = False, meta: dict | None = None
):
    """``ChunkFiles`` when ``io`` is given (O_DIRECT works here) and the layout is plain, else
    ``TsSlices``; ``meta``: the array's zarr.json if the caller has read it already."""
    meta = plain_layout(directory, meta) if io is not None else None
    if meta is None:
        return TsSlices(open_array(directory, context, write=write))
    rows, numel = meta["shape"]
    cols = meta["chunk_grid"]["configuration"]["chunk_shape"][1]
    return ChunkFiles(
        directory,
        rows,
        numel,
        cols,
        torch_dtype(meta["data_type"], directory),
        io,
        checksums=meta["codecs"] == CRC32C_CODECS,
    )


class TsSlices:
    """Slices of a tensorstore array, moved by tensorstore's file driver."""

    def __init__(self, array):
        self.array = array
        self.shape, self.dtype_name = tuple(array.shape), array.dtype.name

    def read_into_(self, row: int, start: int, out: torch.Tensor):
        return read_into_(self.array, row, start, out)

    def write_from(self, row: int, start: int, src: torch.Tensor):
        return write_from(self.array, row, start, src)


class ChunkFiles:
    """One plain zarr3 array of ``(1, cols)`` chunks whose files this process reads and writes
    itself; ``checksums``: each file ends with the crc32c of its bytes."""

    def __init__(
        self,
        directory: str,
        rows: int,
        numel: int,
        cols: int,
        dtype: torch.dtype,
        io: ChunkIO,
        checksums: bool = False,
    ):
        self.directory, self.rows, self.numel, self.cols, self.dtype, self.io = (
            directory,
            rows,
            numel,
            cols,
            dtype,
            io,
        )
        self.shape = (rows, numel)
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.chunk_bytes = cols * dtype.itemsize
        self.checksums = checksums
        self.file_bytes = chunk_file_bytes(cols, dtype.itemsize, checksums)

    def chunk_path(self, row: int, c: int) -> str:
        return os.path.join(self.directory, "c", str(row), str(c))

    def read_into_(self, row: int, start: int, out: torch.Tensor) -> Future:
        """Start reading ``[row, start:start + len(out)]`` into ``out`` (contiguous, CPU, this
        dtype): each chunk file's part in ``READ_PIECE_BYTES`` requests, several in flight (see the
        module's docstring)."""
        self._check(row, start, out, "read")
        n, item = out.numel(), self.dtype.itemsize
        raw = out.view(torch.uint8)
        fds, pieces = [], []
        try:
            for c in range(start // self.cols, (start + n - 1) // self.cols + 1):
                fds.append(pair := self._open_chunk(row, c))
                base = (c * self.cols - start) * item  # where the chunk's byte 0 falls in ``raw``
                first, last = max(0, -base), min(self.chunk_bytes, raw.numel() - base)
                if self.checksums:  # the whole chunk file, its crc32c compared (chunkcrc)
                    dest = raw[base + first : base + last]
                    pieces.append(self._checked_piece(pair, row, c, first, dest))
                    continue
                bounds = [
                    first,
                    *range(
                        odirect.align_down(first, READ_PIECE_BYTES) + READ_PIECE_BYTES,
                        last,
                        READ_PIECE_BYTES,
                    ),
                    last,
                ]  # file bytes, split on piece boundaries
                for a, b in itertools.pairwise(bounds):
                    pieces.append(
                        lambda pair=pair, a=a, dest=raw[base + a : base + b]: self._read_span(
                            pair, a, dest
                        )
                    )
        except ValueError as e:
            _close_all(fds)
            return failed(e)
        return self._run(pieces, finish=None, always=lambda: _close_all(fds))

    def write_from(self, row: int, start: int, src: torch.Tensor) -> Future:
        """Start writing ``src`` as the chunks from element ``start`` (a chunk boundary) on; the
        future resolves once every chunk is written (``src`` must not change until then), durable
        after ``ChunkIO.sync``."""
        self._check(row, start, src, "write")
        if start % self.cols:
            raise ValueError(
                f"{self.directory!r}: a write must start on a chunk boundary (a multiple of "
                f"{self.cols}), got element {start}"
            )
        os.makedirs(os.path.join(self.directory, "c", str(row)), exist_ok=True)
        n, item = src.numel(), self.dtype.itemsize
        raw = src.view(torch.uint8)
        pieces = []
        for c in range(start // self.cols, (start + n - 1) // self.cols + 1):
            lo, hi = c * self.cols, min(start + n, (c + 1) * self.cols)
            data = raw[(lo - start) * item : (hi - start) * item]
            path = self.chunk_path(row, c)
            # with checksums its crc32c starts now, on the crc threads, beside the write (chunkcrc)
            sealed = (
                SealedWrite(path, data, self.chunk_bytes, self.io.align, self.io.crc_pool)
                if self.checksums
                else None
            )
            pieces.append(
                lambda path=path, data=data, sealed=sealed: self._write_chunk(path, data, sealed)
            )
        return self._run(
            pieces, finish=lambda: self.io.written(os.path.join(self.directory, "c", str(row)))
        )

    def _open_chunk(self, row: int, c: int) -> tuple[int | None, int]:
        """``files.open_pair`` of chunk file ``(row, c)``, checked to hold one whole chunk."""
        path = self.chunk_path(row, c)
        try:  # never through a symlink out of the array
            fds = files.open_pair(path, os.O_RDONLY, direct=True, nofollow=True)
        except FileNotFoundError:
            raise ValueError(f"chunk file {path!r} is missing") from None
        except OSError as e:  # ELOOP: a symlink
            raise ValueError(
                f"chunk file {path!r} cannot be opened as a regular file: {e.strerror or e}"
            ) from None
        size = os.fstat(fds[1]).st_size
        if size != self.file_bytes:
            _close_all(fds)
            crc = " + a crc32c" if self.checksums else ""
            raise ValueError(
                f"chunk file {path!r} has {size} bytes, expected {self.file_bytes} "
                f"({self.cols} x {self.dtype}{crc})"
            )
        return fds

    def _checked_piece(
        self, fds: tuple[int | None, int], row: int, c: int, first: int, dest: torch.Tensor
    ):
        """The read request of chunk ``(row, c)`` into ``dest`` (its bytes from ``first`` on): the
        file read whole through the thread's staging windows, its crc32c compared (``chunkcrc``;
        ValueError naming the file)."""

        def piece():
            fd = fds[1] if fds[0] is None else fds[0]
            check = CheckedRead(self.chunk_bytes, first, dest)
            check.read(self.io, fd, self.io.align, self.chunk_path(row, c), STAGE_BYTES)

        return piece

    def _read_span(self, fds: tuple[int | None, int], offset: int, dest: torch.Tensor) -> None:
        """On an I/O thread: bytes ``[offset, offset + len(dest))`` of a chunk file into ``dest``:
        O_DIRECT straight into it where ``dest`` and ``offset`` are aligned (unless
        ``stage_reads``), through the thread's staging buffer for the rest; buffered where the file
        takes no O_DIRECT."""
        direct, align = fds[0], self.io.align
        if direct is None:
            return files.read_span_(fds, offset, dest, align)
        cut = (
            0
            if self.io.stage_reads or not odirect.is_aligned(align, dest.data_ptr(), offset)
            else odirect.align_down(dest.numel(), align)
        )
        if cut and odirect.pread_full(direct, memoryview(dest[:cut].numpy()), offset) < cut:
            raise OSError(errno.EIO, f"unexpected end of chunk file at byte {offset + cut}")
        if cut < dest.numel():
            files.read_staged_(self.io, direct, offset + cut, dest[cut:], align, STAGE_BYTES)

    def _write_chunk(self, path: str, data: torch.Tensor, sealed: SealedWrite | None) -> None:
        """On an I/O thread: ``data`` as the file ``path`` (a whole chunk: zeros past ``data``; then
        its crc32c, by ``sealed``, with checksums), durable at ``sync``."""
        if sealed is not None:
            sealed.write()
        else:
            fds = files.create(path, self.file_bytes, direct=True)
            try:
                files.write_span(fds, 0, data, self.io.align)
            finally:
                _close_all(fds)
        self.io.written(path)  # its size and block map become durable at ``ChunkIO.sync``

    def _run(self, pieces: list, finish, always=None) -> Future:
        """One future for ``pieces`` on the I/O threads: ``always()`` runs once all have run, then
        ``finish()`` if all succeeded."""

        def done(error):
            if always is not None:
                always()
            if error is None and finish is not None:
                finish()

        return self.io.run(pieces, done)

    def _check(self, row: int, start: int, t: torch.Tensor, what: str) -> None:
        if not 0 <= row < self.rows or start < 0 or start + t.numel() > self.numel:
            raise IndexError(
                f"{self.directory!r}: {what} of row {row}, elements [{start}, {start + t.numel()}) "
                f"is outside the array's shape {self.shape}"
            )
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != self.dtype:
            raise ValueError(
                f"{self.directory!r}: {what} needs a contiguous CPU {self.dtype} tensor, got "
                f"{t.dtype} on {t.device}"
            )
        if t.numel() == 0:
            raise ValueError(
                f"{self.directory!r}: {what} of an empty slice (row {row}, element {start})"
            )


def _close_all(fds) -> None:
    """Close descriptors: ints, Nones and pairs of them (``files.open_pair``)."""
    for fd in fds:
        if isinstance(fd, tuple):
            _close_all(fd)
        elif fd is not None:
            os.close(fd)
