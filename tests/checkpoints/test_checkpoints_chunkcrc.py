"""A checksummed chunk file's crc32c, computed beside the write and inside the read
(``checkpoints.chunkcrc``): the read's windows may cut the data and the stored crc32c anywhere, a
reader may want any part of the chunk, and a write that fails on either side leaves no descriptor
open and no crc32c sealing bytes that were not written. The files themselves equal tensorstore's
(test_checkpoints_chunkio)."""

from __future__ import annotations

import os
import struct

import crc32c
import pytest
import torch

from checkpoints import chunkcrc
from checkpoints.arrays import array_spec, write_metadata
from checkpoints.chunkcrc import CheckedRead
from checkpoints.chunkio import ChunkFiles, ChunkIO
from zinf_fn.io import files, odirect

WINDOW = 4096


def data(n: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)
    )


def sealed_file(path: str, chunk: torch.Tensor) -> None:
    """A chunk file as zarr's crc32c codec writes it (the reference): bytes, then their crc32c."""
    with open(path, "wb") as f:
        f.write(chunk.numpy().tobytes() + struct.pack("<I", crc32c.crc32c(chunk.numpy())))


def read_checked(io, path: str, chunk_bytes: int, first: int, dest: torch.Tensor) -> None:
    fds = files.open_pair(path, os.O_RDONLY, direct=True)
    try:
        fd = fds[1] if fds[0] is None else fds[0]
        CheckedRead(chunk_bytes, first, dest).read(io, fd, odirect.ALIGN, path, WINDOW)
    finally:
        files.close_pair(fds)


@pytest.fixture
def io():
    pool = files.FileIO(1, "test-crc")
    yield pool
    pool.close()


# chunk sizes: the crc32c inside the last window, straddling two windows (a window ends 2 bytes
# into it), starting a window, and a chunk inside one window
@pytest.mark.parametrize("chunk_bytes", [3 * WINDOW + 100, 2 * WINDOW - 2, 2 * WINDOW, 1000])
def test_any_part_of_a_chunk_reads_bitwise_and_any_flipped_byte_is_refused(
    tmp_path, io, chunk_bytes
):
    chunk = data(chunk_bytes)
    path = str(tmp_path / "0")
    sealed_file(path, chunk)
    for first, last in ((0, chunk_bytes), (1, chunk_bytes), (0, 7), (WINDOW - 3, chunk_bytes - 1)):
        if last <= first:
            continue
        dest = torch.zeros(last - first, dtype=torch.uint8)
        read_checked(io, path, chunk_bytes, first, dest)
        assert torch.equal(dest, chunk[first:last]), (first, last)
    for at in (0, chunk_bytes - 1, chunk_bytes, chunk_bytes + 3):  # data, then the stored crc32c
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x10]))
        with pytest.raises(ValueError, match=r"crc32c 0x[0-9a-f]{8}, the file stores 0x"):
            read_checked(io, path, chunk_bytes, 0, torch.empty(chunk_bytes, dtype=torch.uint8))
        sealed_file(path, chunk)
    os.truncate(path, chunk_bytes + 2)  # half a crc32c: an error, never a short read
    with pytest.raises(OSError, match="unexpected end at byte"):
        read_checked(io, path, chunk_bytes, 0, torch.empty(chunk_bytes, dtype=torch.uint8))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("failing", ["data", "crc32c"])
def test_a_failed_side_of_a_sealed_write_fails_the_write_closes_the_file_seals_nothing(
    tmp_path, monkeypatch, failing
):
    numel, cols = 5000, 1536
    write_metadata(array_spec(str(tmp_path / "a"), 1, numel, torch.float32, cols, {}, True))
    io = ChunkIO(odirect.write_alignment(str(tmp_path)))
    chunks = ChunkFiles(str(tmp_path / "a"), 1, numel, cols, torch.float32, io, checksums=True)
    if failing == "data":  # the data's write fails (EIO from the disk)

        def broken(fd, mem, offset):
            raise OSError(5, "injected EIO")

        monkeypatch.setattr(files, "_pwrite_full", broken)
    else:

        def broken_crc(data, chunk_bytes):
            raise RuntimeError("injected crc32c failure")

        monkeypatch.setattr(chunkcrc, "crc32c_tail", broken_crc)
    before = _open_fds()
    with pytest.raises((OSError, RuntimeError), match="injected"):
        chunks.write_from(0, 0, torch.randn(numel)).result()
    io.close()  # every piece and crc32c has ended
    assert _open_fds() == before
    for c in range(4):  # allocated whole, zeros: no crc32c of bytes that are not there
        path = chunks.chunk_path(0, c)
        assert os.path.getsize(path) == cols * 4 + 4
        with open(path, "rb") as f:
            assert f.read()[-4:] == bytes(4)
