"""Moving slices of checkpoint arrays: chunk files read and written with O_DIRECT, or through tensorstore.

A checkpoint array with the plain ``bytes`` codec (no checksums) stores chunk ``(row, c)`` of shape
``(1, cols)`` as the file ``<array>/c/<row>/<c>``: exactly ``cols * itemsize`` raw little-endian bytes
(the chunk at the row's end is full size too, zero past the last element). ``ChunkFiles`` reads and
writes those files itself, several chunks in flight on ``ChunkIO``'s threads, with ``O_DIRECT``: a
chunk whose memory, offset and length are aligned moves straight between the disk and the tensor, in
one request; any other goes through its thread's page-aligned staging buffer (``STAGE_BYTES`` at a
time) and one memcpy. The files are the ones
tensorstore writes and reads (tests compare both ways, bitwise). ``TsSlices`` is the tensorstore twin,
used where O_DIRECT is refused or the codec chain is not plain bytes (``checksums=True``).

Durability on save: O_DIRECT puts the bytes on the disk before ``write_from``'s future resolves (the
source may then be reused); ``ChunkIO.sync`` then fsyncs every chunk file and row directory ``c/<row>``
written, all at once, so one journal commit covers most of them (measured a little faster than an
fsync per file); ``commit.fsync_tree`` covers every other file and directory.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zinf_fn import odirect
from zinf_fn.buffers import aligned_empty
from zinf_fn.direct_io import Joined

from .arrays import TORCH_DTYPES, open_array, read_into_, torch_dtype, write_from

IO_THREADS = 8             # chunk requests in flight per save or restore (the disk wants a deep queue)
STAGE_BYTES = 4 << 20      # staging window per I/O thread (a multiple of every O_DIRECT alignment)
PLAIN_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}]


class ChunkIO:
    """The I/O threads of one save or restore, each with its own reused page-aligned staging buffer;
    ``align``: the file system's O_DIRECT alignment (``odirect.read_alignment`` / ``write_alignment``)."""

    def __init__(self, align: int, threads: int = IO_THREADS):
        self.align = align
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="zinf-ckpt-io")
        self._local = threading.local()
        self._unsynced: list[str] = []    # files and directories written, not yet fsynced
        self._lock = threading.Lock()

    def written(self, path: str) -> None:
        with self._lock:
            self._unsynced.append(path)

    def sync(self) -> None:
        """fsync every file and directory written so far, in parallel: they are durable on return."""
        with self._lock:
            paths, self._unsynced = list(dict.fromkeys(self._unsynced)), []
        list(self.pool.map(fsync_path, paths))   # sync: one journal commit covers most of them

    def staging(self, nbytes: int) -> torch.Tensor:
        """This thread's staging buffer, at least ``nbytes`` long (uint8, page-aligned)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.buf = aligned_empty(odirect.align_up(nbytes), torch.uint8)
        return buf[:nbytes]

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def plain_layout(directory: str) -> dict | None:
    """The array's zarr.json if its chunks are plain ``(1, cols)`` raw little-endian files, else None."""
    try:
        with open(os.path.join(directory, "zarr.json")) as f:
            meta = json.load(f)
        grid = meta["chunk_grid"]
        key_encoding = meta["chunk_key_encoding"]
        plain = (meta.get("zarr_format") == 3 and meta.get("node_type") == "array" and len(meta["shape"]) == 2
                 and grid["name"] == "regular" and grid["configuration"]["chunk_shape"][0] == 1
                 and key_encoding["name"] == "default"
                 and key_encoding.get("configuration", {}).get("separator", "/") == "/"
                 and meta["codecs"] == PLAIN_CODECS and meta["fill_value"] == 0
                 and meta["data_type"] in TORCH_DTYPES and not meta.get("storage_transformers"))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    return meta if plain else None


def open_slices(directory: str, context, io: ChunkIO | None, write: bool = False):
    """``ChunkFiles`` when ``io`` is given (O_DIRECT works here) and the layout is plain, else ``TsSlices``."""
    meta = plain_layout(directory) if io is not None else None
    if meta is None:
        return TsSlices(open_array(directory, context, write=write))
    rows, numel = meta["shape"]
    cols = meta["chunk_grid"]["configuration"]["chunk_shape"][1]
    return ChunkFiles(directory, rows, numel, cols, torch_dtype(meta["data_type"], directory), io)


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
    """One plain zarr3 array of ``(1, cols)`` chunks whose files this process reads and writes itself."""

    def __init__(self, directory: str, rows: int, numel: int, cols: int, dtype: torch.dtype, io: ChunkIO):
        self.directory, self.rows, self.numel, self.cols, self.dtype, self.io = directory, rows, numel, cols, dtype, io
        self.shape = (rows, numel)
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.chunk_bytes = cols * dtype.itemsize

    def chunk_path(self, row: int, c: int) -> str:
        return os.path.join(self.directory, "c", str(row), str(c))

    def read_into_(self, row: int, start: int, out: torch.Tensor) -> Future:
        """Start reading ``[row, start:start + len(out)]`` into ``out`` (contiguous, CPU, this dtype)."""
        self._check(row, start, out, "read")
        n, item = out.numel(), self.dtype.itemsize
        raw = out.view(torch.uint8)
        pieces = []
        for c in range(start // self.cols, (start + n - 1) // self.cols + 1):
            lo, hi = max(start, c * self.cols), min(start + n, (c + 1) * self.cols)
            dest = raw[(lo - start) * item : (hi - start) * item]
            pieces.append(lambda c=c, lo=lo, dest=dest: self._read_chunk(row, c, (lo - c * self.cols) * item, dest))
        return self._run(pieces, finish=None)

    def write_from(self, row: int, start: int, src: torch.Tensor) -> Future:
        """Start writing ``src`` as the chunks from element ``start`` (a chunk boundary) on; the future
        resolves once every chunk is written (``src`` must not change until then), durable after
        ``ChunkIO.sync``."""
        self._check(row, start, src, "write")
        if start % self.cols:
            raise ValueError(f"{self.directory!r}: a write must start on a chunk boundary (a multiple of "
                             f"{self.cols}), got element {start}")
        os.makedirs(os.path.join(self.directory, "c", str(row)), exist_ok=True)
        n, item = src.numel(), self.dtype.itemsize
        raw = src.view(torch.uint8)
        pieces = []
        for c in range(start // self.cols, (start + n - 1) // self.cols + 1):
            lo, hi = c * self.cols, min(start + n, (c + 1) * self.cols)
            data = raw[(lo - start) * item : (hi - start) * item]
            pieces.append(lambda c=c, data=data: self._write_chunk(self.chunk_path(row, c), data))
        return self._run(pieces, finish=lambda: self.io.written(os.path.join(self.directory, "c", str(row))))

    def _read_chunk(self, row: int, c: int, offset: int, dest: torch.Tensor) -> None:
        """On an I/O thread: bytes ``[offset, offset + len(dest))`` of chunk file ``(row, c)`` into ``dest``."""
        path = self.chunk_path(row, c)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except FileNotFoundError:
            raise ValueError(f"chunk file {path!r} is missing") from None
        try:
            size = os.fstat(fd).st_size
            if size != self.chunk_bytes:
                raise ValueError(f"chunk file {path!r} has {size} bytes, expected {self.chunk_bytes} "
                                 f"({self.cols} x {self.dtype})")
            n = dest.numel()
            align = self.io.align
            if odirect.is_aligned(align, dest.data_ptr(), offset, n):
                odirect.pread_full(fd, memoryview(dest.numpy()), offset)   # straight into the destination
                return
            first, end = odirect.align_down(offset, align), odirect.align_up(offset + n, align)
            for lo in range(first, end, STAGE_BYTES):   # staged, a bounded window at a time
                hi = min(end, lo + STAGE_BYTES)
                buf = self.io.staging(hi - lo)
                odirect.pread_full(fd, memoryview(buf.numpy()), lo)   # the file ends first where hi > size
                a, b = max(lo, offset), min(hi, offset + n)
                dest[a - offset : b - offset].copy_(buf[a - lo : b - lo])
        finally:
            os.close(fd)

    def _write_chunk(self, path: str, data: torch.Tensor) -> None:
        """On an I/O thread: ``data`` (zero-padded to a whole chunk) as the durable file ``path``."""
        size, align = self.chunk_bytes, self.io.align
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            if data.numel() == size and odirect.is_aligned(align, data.data_ptr(), size):
                odirect.pwrite_full(fd, memoryview(data.numpy()), 0)   # straight from the source
            else:
                for lo in range(0, size, STAGE_BYTES):   # staged, a bounded window at a time
                    hi = min(size, lo + STAGE_BYTES)
                    buf = self.io.staging(odirect.align_up(hi - lo, align))
                    n = max(0, min(hi, data.numel()) - lo)
                    buf[:n].copy_(data[lo : lo + n])
                    buf[n:].zero_()                                     # fill value past the last element
                    odirect.pwrite_full(fd, memoryview(buf.numpy()), lo)
                if size % align:
                    os.ftruncate(fd, size)                              # the aligned write's padding
            self.io.written(path)   # its size and block map become durable at ``ChunkIO.sync``
        finally:
            os.close(fd)

    def _run(self, pieces: list, finish) -> Future:
        """One future for ``pieces`` on the I/O threads; ``finish()`` runs after all succeeded."""
        joined = Joined(len(pieces), lambda error: finish() if error is None and finish is not None else None)
        for piece in pieces:
            self.io.pool.submit(joined.run, piece)
        return joined.future

    def _check(self, row: int, start: int, t: torch.Tensor, what: str) -> None:
        if not 0 <= row < self.rows or start < 0 or start + t.numel() > self.numel:
            raise IndexError(f"{self.directory!r}: {what} of row {row}, elements [{start}, {start + t.numel()}) "
                             f"is outside the array's shape {self.shape}")
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != self.dtype:
            raise ValueError(f"{self.directory!r}: {what} needs a contiguous CPU {self.dtype} tensor, got "
                             f"{t.dtype} on {t.device}")
        if t.numel() == 0:
            raise ValueError(f"{self.directory!r}: {what} of an empty slice (row {row}, element {start})")


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
