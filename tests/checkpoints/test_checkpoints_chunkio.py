"""The O_DIRECT chunk-file path of checkpoints against its slow twin, tensorstore's zarr3 driver.

Storage moves data, so every comparison is bitwise: slices read by ``ChunkFiles`` equal
tensorstore's reads of the same arrays, chunk files it writes equal tensorstore's byte for byte, and
a whole save or restore gives the same files and states on either path (the tensorstore path is
forced by making the O_DIRECT probe fail, as tmpfs on older kernels does).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import tensorstore as ts
import torch
from ckpt_workers import config, local_rows, model, optimizer, train
from engine_helpers import batches

import checkpoints
import zinf_fn as zf
from checkpoints import chunkio
from checkpoints.arrays import array_spec, as_numpy, io_context, open_array, write_metadata
from checkpoints.chunkio import ChunkFiles, ChunkIO, TsSlices, open_slices, plain_layout
from checkpoints.manifest import CheckpointError
from zinf_fn.io import odirect
from zinf_fn.io.buffers import aligned_empty

ROWS, NUMEL, COLS = 3, 5000, 1536  # chunks of 6 KiB (fp32): never 4096-aligned, partly 512-aligned


@pytest.fixture(
    params=[(512, False), (4096, False), (4096, True)],
    ids=["align512", "align4096", "align4096-staged-reads"],
)
def io(request, tmp_path):
    want, stage_reads = request.param
    align = odirect.write_alignment(str(tmp_path))
    if align is None or align > want:
        pytest.fail(
            f"O_DIRECT at alignment {want} is refused under {tmp_path}; run the tests on a "
            "file system that takes it (ext4, xfs)"
        )
    chunk_io = ChunkIO(want, stage_reads=stage_reads)
    yield chunk_io
    chunk_io.close()


def random_rows(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(ROWS, NUMEL, generator=torch.Generator().manual_seed(seed)).to(dtype)


def ts_array(
    directory,
    dtype: torch.dtype,
    data: torch.Tensor | None = None,
    checksums: bool = False,
    cols: int = COLS,
):
    """A checkpoint-style zarr3 array written by tensorstore (the reference)."""
    spec = array_spec(str(directory), ROWS, NUMEL, dtype, cols, {}, checksums)
    array = ts.open(spec, create=True, delete_existing=True, context=io_context()).result()
    if data is not None:
        for row in range(ROWS):
            array[row].write(as_numpy(data[row].contiguous())).result()
    return array


def chunk_bytes(directory) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(os.path.join(directory, "c")):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dirpath, f), directory)] = fh.read()
    return out


SLICES = [
    (0, 0, NUMEL),
    (1, 0, COLS),
    (2, COLS, 2 * COLS),
    (0, 1, 4999),
    (1, 700, 3100),
    (2, 4600, 5000),
    (0, 1024, 2048),
    (1, 3 * COLS, NUMEL),
]


@pytest.fixture(params=[4096, None], ids=["stage4k", "stage-default"])
def stage(request, monkeypatch):
    """Staging windows and read requests of one page (a chunk takes several) or the defaults (one
    window and one request per chunk)."""
    if request.param is not None:
        monkeypatch.setattr(chunkio, "STAGE_BYTES", request.param)
        monkeypatch.setattr(chunkio, "READ_PIECE_BYTES", request.param)


@pytest.mark.parametrize("checksums", [False, True], ids=["plain", "crc32c"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_equal_tensorstore_reads_for_any_slice_and_destination_alignment(
    tmp_path, io, stage, dtype, checksums
):
    data = random_rows(dtype)
    array = ts_array(tmp_path / "a", dtype, data, checksums)
    ours = open_slices(str(tmp_path / "a"), io_context(), io)
    assert isinstance(ours, ChunkFiles) and ours.checksums == checksums
    for row, start, end in SLICES:
        for shift in (0, 1, 128):  # destination on a page boundary, and two elements off it
            out = aligned_empty(end - start + shift, dtype)[shift:]
            ours.read_into_(row, start, out).result()
            want = torch.empty(end - start, dtype=dtype)
            TsSlices(array).read_into_(row, start, want).result()
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (
                row,
                start,
                end,
                shift,
            )
            assert torch.equal(out, data[row, start:end])


@pytest.mark.parametrize("checksums", [False, True], ids=["plain", "crc32c"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_chunk_files_equal_tensorstore_files_byte_for_byte(
    tmp_path, io, stage, dtype, checksums
):
    data = random_rows(dtype, seed=1)
    ts_array(tmp_path / "ref", dtype, data, checksums)
    ts_array(tmp_path / "ours", dtype, checksums=checksums)  # metadata only, as a save creates it
    ours = open_slices(str(tmp_path / "ours"), io_context(), io, write=True)
    for row in range(ROWS):
        for start in range(
            0, NUMEL, 2 * COLS
        ):  # two chunks per write, the last one short (row end)
            src = data[row, start : min(NUMEL, start + 2 * COLS)].clone()
            ours.write_from(row, start, src).result()
    assert chunk_bytes(tmp_path / "ours") == chunk_bytes(tmp_path / "ref")
    back = torch.empty(ROWS, NUMEL, dtype=dtype)
    as_numpy(back)[...] = (
        open_array(str(tmp_path / "ours"), io_context()).read().result()
    )  # plain tensorstore
    assert torch.equal(back, data)


@pytest.mark.parametrize("checksums", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_array_metadata_equals_what_tensorstore_creates(tmp_path, dtype, checksums):
    attributes = {"zinf_fn": {"group": "blocks", "kind": "master"}}
    specs = [
        array_spec(str(tmp_path / name), ROWS, NUMEL, dtype, COLS, attributes, checksums)
        for name in "ab"
    ]
    ts.open(specs[0], create=True, context=io_context()).result()
    written = write_metadata(specs[1])
    with open(tmp_path / "a" / "zarr.json") as ref, open(written) as ours:
        assert json.load(ours) == json.load(ref)
    assert tuple(open_array(str(tmp_path / "b"), io_context()).shape) == (ROWS, NUMEL)


def test_aligned_chunks_move_straight_between_disk_and_tensor(tmp_path, monkeypatch):
    chunk_io = ChunkIO(odirect.ALIGN, stage_reads=False)
    monkeypatch.setattr(
        chunk_io, "staging", lambda nbytes: pytest.fail("a staging copy of an aligned chunk")
    )
    ts_array(tmp_path / "a", torch.float32, cols=1024)  # 4 KiB chunks
    ours = open_slices(str(tmp_path / "a"), io_context(), chunk_io, write=True)
    src = aligned_empty(4 * 1024, torch.float32).copy_(
        torch.arange(4 * 1024.0)
    )  # chunks 0-3 of row 0
    ours.write_from(0, 0, src).result()
    back = aligned_empty(2 * 1024, torch.float32)
    ours.read_into_(0, 1024, back).result()
    chunk_io.close()
    assert torch.equal(back, src[1024:3072])
    with open(tmp_path / "a" / "c" / "0" / "3", "rb") as f:
        assert np.array_equal(
            np.frombuffer(f.read(), np.float32), np.arange(3 * 1024.0, 4 * 1024.0)
        )


def test_bad_slices_and_chunk_files_raise_naming_what_came(tmp_path, io):
    ts_array(tmp_path / "a", torch.float32, random_rows(torch.float32))
    ours = open_slices(str(tmp_path / "a"), io_context(), io, write=True)
    with pytest.raises(
        ValueError, match="must start on a chunk boundary.*multiple of 1536.*element 10"
    ):
        ours.write_from(0, 10, torch.zeros(5))
    with pytest.raises(ValueError, match="contiguous CPU torch.float32 tensor, got torch.bfloat16"):
        ours.read_into_(0, 0, torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(
        IndexError, match=r"row 3, elements \[0, 5\) is outside the array's shape \(3, 5000\)"
    ):
        ours.read_into_(3, 0, torch.zeros(5))
    os.truncate(tmp_path / "a" / "c" / "1" / "2", 100)
    with pytest.raises(
        ValueError, match=r"c/1/2' has 100 bytes, expected 6144 \(1536 x torch.float32\)"
    ):
        ours.read_into_(1, 3000, torch.zeros(200)).result()
    os.remove(tmp_path / "a" / "c" / "2" / "0")
    with pytest.raises(ValueError, match=r"c/2/0' is missing"):
        ours.read_into_(2, 0, torch.zeros(200)).result()


def test_a_flipped_bit_of_a_checksummed_chunk_is_refused_naming_the_file(tmp_path, io):
    ts_array(tmp_path / "crc", torch.float32, random_rows(torch.float32), checksums=True)
    ours = open_slices(str(tmp_path / "crc"), io_context(), io)
    chunk = tmp_path / "crc" / "c" / "1" / "2"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x04
    chunk.write_bytes(bytes(data))
    for start, n in ((2 * COLS, COLS), (3000, 200)):  # the whole chunk, a part (read whole too)
        with pytest.raises(ValueError, match=r"c/1/2': crc32c 0x[0-9a-f]{8}, the file stores 0x"):
            ours.read_into_(1, start, torch.zeros(n)).result()
    os.truncate(chunk, 6144)  # the bytes without their crc32c
    with pytest.raises(ValueError, match=r"c/1/2' has 6144 bytes, expected 6148 \(.* \+ a crc"):
        ours.read_into_(1, 3000, torch.zeros(200)).result()


def test_other_codecs_and_refused_o_direct_use_tensorstore(tmp_path, io):
    spec = array_spec(str(tmp_path / "zstd"), ROWS, NUMEL, torch.float32, COLS, {})
    zstd = {"name": "zstd", "configuration": {"level": 1, "checksum": False}}
    spec["metadata"]["codecs"].append(zstd)
    ts.open(spec, create=True, context=io_context()).result()
    assert plain_layout(str(tmp_path / "zstd")) is None
    assert isinstance(open_slices(str(tmp_path / "zstd"), io_context(), io), TsSlices)
    ts_array(tmp_path / "plain", torch.float32)
    assert isinstance(open_slices(str(tmp_path / "plain"), io_context(), None), TsSlices)


def force_tensorstore(monkeypatch):
    monkeypatch.setattr(odirect, "write_alignment", lambda directory: None)
    monkeypatch.setattr(odirect, "read_alignment", lambda path: None)


@pytest.mark.parametrize("placement", ["none", "cpu"])
def test_save_and_restore_equal_on_both_paths(tmp_path, monkeypatch, placement):
    state = train(zf.init(model(), optimizer(), config(placement)), batches(2))[0]
    direct = checkpoints.save(tmp_path / "direct", state)
    with monkeypatch.context() as m:
        force_tensorstore(m)
        slow = checkpoints.save(tmp_path / "ts", state)
        from_slow = local_rows(checkpoints.restore(direct, model(), optimizer(), config(placement)))
    arrays = [e["name"] for e in checkpoints.read_manifest(direct)["arrays"]]
    for name in arrays:
        assert chunk_bytes(os.path.join(direct, name)) == chunk_bytes(os.path.join(slow, name)), (
            name
        )
    from_direct = local_rows(checkpoints.restore(slow, model(), optimizer(), config(placement)))
    want = local_rows(state)
    for rows in (from_slow, from_direct):
        assert rows.keys() == want.keys()
        assert all(torch.equal(rows[k], want[k]) for k in want)


def test_probes_find_an_alignment_and_leave_nothing_behind(tmp_path):
    align = odirect.write_alignment(str(tmp_path))
    assert align in odirect.CANDIDATES
    assert os.listdir(tmp_path) == []
    path = tmp_path / "f"
    path.write_bytes(bytes(3 * odirect.ALIGN))
    assert odirect.read_alignment(str(path)) == align
    path.write_bytes(bytes(100))
    assert odirect.read_alignment(str(path)) == odirect.ALIGN  # too short to try a smaller offset
    assert odirect.read_alignment(str(tmp_path / "missing")) is None


def test_truncated_chunk_on_the_direct_path_is_a_checkpoint_error(tmp_path):
    state = zf.init(model(), optimizer(), config("cpu"))
    path = checkpoints.save(tmp_path / "ck", state)
    chunk = os.path.join(path, "blocks", "adam_v", "c", "1", "0")
    os.truncate(chunk, os.path.getsize(chunk) // 2)
    with pytest.raises(
        CheckpointError, match=r"blocks/adam_v', row 1, is corrupt: chunk file .* has \d+ bytes"
    ):
        checkpoints.restore(path, model(), optimizer(), config("cpu"))


def test_reread_overwrites_a_state_of_the_same_layout_bitwise(tmp_path):
    state = train(zf.init(model(), optimizer(), config("cpu")), batches(2))[0]
    path = checkpoints.save(tmp_path / "ck", state)
    other = zf.init(model(), optimizer(), config("cpu"), seed=1)
    nbytes = sys.modules["checkpoints.restore"].reread_(path, other)
    assert nbytes == sum(t.numel() * t.element_size() for t in local_rows(state).values())
    want, got = local_rows(state), local_rows(other)
    assert all(torch.equal(got[k], want[k]) for k in want)
