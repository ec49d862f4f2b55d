"""The one O_DIRECT file layer (``zinf_fn.io.files``): the one way a file is made (``create``) and
the one fallback for data O_DIRECT cannot take (``read_span_`` / ``write_span``: the rest through
the buffered descriptor), as the engine's NVMe tier (``DirectFiles``) and checkpoints (``chunkio``)
use them. Storage moves, so every comparison is bitwise."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from checkpoints.arrays import array_spec, write_metadata
from checkpoints.chunkio import ChunkFiles, ChunkIO
from zinf_fn.io import direct_files, files, odirect
from zinf_fn.io.buffers import aligned_empty
from zinf_fn.offload.nvme import NvmeTier

SIZE = 3 * 4096 + 5  # a sub-page tail


def pattern(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def on_disk(path) -> torch.Tensor:
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)


def shifted(data: torch.Tensor, shift: int) -> torch.Tensor:
    """``data`` copied to memory ``shift`` bytes off a page boundary."""
    out = aligned_empty(data.numel() + shift, torch.uint8)[shift:]
    return out.copy_(data)


def record_creates(monkeypatch) -> list[tuple[str, int]]:
    """(path, size) of every file ``files.create`` makes from now on."""
    made, real = [], files.create

    def create(path, size, direct):
        made.append((path, size))
        return real(path, size, direct)

    monkeypatch.setattr(files, "create", create)
    return made


@pytest.fixture
def direct(tmp_path) -> bool:
    if odirect.write_alignment(str(tmp_path)) is None:
        pytest.fail(
            f"O_DIRECT is refused under {tmp_path}; run the tests on a file system that takes it"
        )
    return True


def test_create_allocates_the_whole_file_reading_as_zeros(tmp_path, direct):
    path = str(tmp_path / "f")
    fds = files.create(path, SIZE, direct)
    assert fds[0] is not None
    for fd in fds:
        os.close(fd)
    assert (
        os.stat(path).st_size == SIZE and os.stat(path).st_blocks * 512 >= SIZE
    )  # allocated, not sparse
    assert not on_disk(path).any()


def test_create_raises_before_a_byte_is_written_and_leaves_no_descriptor(tmp_path, monkeypatch):
    def no_space(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as info:
        files.create(str(tmp_path / "f"), SIZE, direct=True)
    assert info.value.errno == errno.ENOSPC and len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("shift", [0, 1, 512])
@pytest.mark.parametrize("offset", [0, 4096, 7])
def test_spans_with_unaligned_memory_offsets_and_tails_move_bitwise(
    tmp_path, direct, shift, offset
):
    path = str(tmp_path / "f")
    whole = pattern(SIZE)
    fds = files.create(path, SIZE, direct)
    try:
        files.write_span(fds, 0, shifted(whole, shift), odirect.ALIGN)
        span = pattern(SIZE - offset - 3, seed=1)
        files.write_span(fds, offset, shifted(span, shift), odirect.ALIGN)
    finally:
        for fd in fds:
            os.close(fd)
    want = whole.clone()
    want[offset : offset + span.numel()] = span
    assert torch.equal(on_disk(path), want)
    fds = files.open_pair(path, os.O_RDONLY, direct)
    try:
        out = shifted(torch.zeros(SIZE - offset, dtype=torch.uint8), shift)
        files.read_span_(fds, offset, out, odirect.ALIGN)
    finally:
        for fd in fds:
            os.close(fd)
    assert torch.equal(out, want[offset:])


def test_a_short_file_is_an_error_not_a_short_read(tmp_path, direct):
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(bytes(100))
    fds = files.open_pair(path, os.O_RDONLY, direct)
    with pytest.raises(OSError, match="unexpected end of file"):
        files.read_span_(fds, 0, torch.empty(200, dtype=torch.uint8))
    io = files.FileIO(1, "test")
    with pytest.raises(OSError, match="unexpected end of file at byte 100"):  # staged: the same
        files.read_staged_(io, fds[0], 0, torch.empty(200, dtype=torch.uint8), odirect.ALIGN)
    io.close()
    files.close_pair(fds)


@pytest.mark.parametrize("shift", [0, 2])
def test_nvme_tier_rows_with_tails_round_trip_bitwise_and_are_created_by_create(
    tmp_path, monkeypatch, shift
):
    made = record_creates(monkeypatch)
    tier = NvmeTier(tmp_path, "rank0/params")
    numel = SIZE // 2 * 2 + 1  # bf16 elements: a tail off the page
    tier.allocate("head/param", 2, numel, torch.bfloat16)
    rows = [torch.randn(numel).bfloat16() for _ in range(2)]
    for row, data in enumerate(rows):
        src = shifted(data.view(torch.uint8), shift).view(torch.bfloat16)
        tier.write_("head/param", row, src).result()
    piece = torch.randn(1001).bfloat16()
    tier.write_("head/param", 1, piece, start=7).result()  # in place, at an unaligned offset
    rows[1][7:1008] = piece
    for row, data in enumerate(rows):
        out = shifted(torch.zeros(numel * 2, dtype=torch.uint8), shift).view(torch.bfloat16)
        tier.read_("head/param", row, out).result()
        assert torch.equal(out.view(torch.int16), data.view(torch.int16)), row
        written = on_disk(tier.row_path("head/param", row))
        assert torch.equal(written, data.view(torch.uint8))
    tier.close()
    assert [size for _, size in made] == [
        numel * 2,
        numel * 2,
    ]  # one create per row file, the first write


@pytest.mark.parametrize("shift", [0, 8])
def test_chunk_files_with_tails_round_trip_bitwise_and_are_created_by_create(
    tmp_path, monkeypatch, direct, shift
):
    made = record_creates(monkeypatch)
    numel, cols = (
        5000,
        1537,
    )  # chunks of 6148 bytes: tails off every alignment; the last chunk short
    write_metadata(array_spec(str(tmp_path / "a"), 1, numel, torch.float32, cols, {}))
    io = ChunkIO(odirect.write_alignment(str(tmp_path)))
    chunks = ChunkFiles(str(tmp_path / "a"), 1, numel, cols, torch.float32, io)
    data = torch.randn(numel)
    chunks.write_from(0, 0, shifted(data.view(torch.uint8), shift).view(torch.float32)).result()
    assert len(made) == 4 and {size for _, size in made} == {cols * 4}
    last = on_disk(chunks.chunk_path(0, 3)).view(torch.float32)
    assert (
        torch.equal(last[: numel - 3 * cols], data[3 * cols :])
        and not last[numel - 3 * cols :].any()
    )
    for stage in (True, False):
        io.stage_reads = stage
        out = shifted(torch.zeros(4000 * 4, dtype=torch.uint8), shift).view(torch.float32)
        chunks.read_into_(0, 999, out).result()
        assert torch.equal(out.view(torch.int32), data[999:4999].view(torch.int32)), stage
    io.close()


def test_pieces_cover_a_transfer_in_the_fewest_aligned_requests():
    block = 4 * odirect.ALIGN
    for nbytes in (0, 1, odirect.ALIGN, SIZE, block, block + 1, 10 * odirect.ALIGN + 7):
        got = odirect.pieces(nbytes, block)
        assert got[0][0] == 0 and got[-1][1] == nbytes, nbytes
        assert all(a[1] == b[0] for a, b in zip(got, got[1:], strict=False)), nbytes  # no gap
        assert all(lo % odirect.ALIGN == 0 and hi - lo <= block for lo, hi in got), nbytes
        assert len(got) == max(1, -(-nbytes // block)), nbytes  # the fewest requests


def test_a_row_moved_in_several_pieces_round_trips_bitwise(tmp_path, monkeypatch, direct):
    # a row of 3 pieces and a tail
    monkeypatch.setattr(direct_files, "BLOCK_BYTES", 2 * odirect.ALIGN)
    tier = NvmeTier(tmp_path, "rank0/params")
    numel = (5 * odirect.ALIGN + 12) // 4
    tier.allocate("blocks/master", 1, numel, torch.float32)
    data = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    tier.write_("blocks/master", 0, data.clone()).result()
    span = torch.randn(2 * odirect.ALIGN // 4 + 5)
    tier.write_("blocks/master", 0, span, start=odirect.ALIGN // 4).result()  # pieces of a span
    data[odirect.ALIGN // 4 : odirect.ALIGN // 4 + span.numel()] = span
    out = aligned_empty(numel, torch.float32)
    tier.read_("blocks/master", 0, out).result()
    path = tier.row_path("blocks/master", 0)
    tier.close()
    assert torch.equal(out.view(torch.int32), data.view(torch.int32))
    assert torch.equal(on_disk(path), data.view(torch.uint8))
