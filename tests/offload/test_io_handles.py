"""The descriptors of the NVMe tier's row files (``zinf_fn.io.handles``): each file opened once per
tier, never closed under a request in flight, closed on ``close``, reopened once replaced."""

from __future__ import annotations

import os

import torch

from zinf_fn.io import files
from zinf_fn.io.handles import OpenFiles
from zinf_fn.offload.nvme import NvmeTier


def _open_descriptors() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _counting_opens(monkeypatch) -> list[str]:
    """Record every path ``files.open_pair`` opens (a missing file opens nothing)."""
    opened, real = [], files.open_pair

    def counted(path, *args, **kwargs):
        fds = real(path, *args, **kwargs)
        opened.append(path)
        return fds

    monkeypatch.setattr(files, "open_pair", counted)
    return opened


def test_a_row_file_is_opened_once_for_every_read_and_write_and_closed_on_close(
    tmp_path, monkeypatch
):
    opened = _counting_opens(monkeypatch)
    before = _open_descriptors()
    tier = NvmeTier(tmp_path, "rank0/optimizer")
    tier.allocate("blocks/master", 2, 5000, torch.float32)
    rows = [torch.randn(5000) for _ in range(2)]
    for row, data in enumerate(rows):
        tier.write_("blocks/master", row, data).result()  # created whole: no descriptor kept
    for _ in range(3):
        for row, data in enumerate(rows):
            out = torch.empty(5000)
            tier.read_("blocks/master", row, out).result()
            assert torch.equal(out, data)
            data[100:600] += 1
            tier.write_("blocks/master", row, data[100:600], start=100).result()  # in place
    assert sorted(opened) == sorted(set(opened)) and len(opened) == 2  # once per file
    tier.close()
    assert _open_descriptors() == before


def test_a_dropped_array_allocated_again_with_another_layout_reads_its_new_files(tmp_path):
    tier = NvmeTier(tmp_path, "rank0/activations")
    tier.allocate("carries", 1, 4096, torch.uint8)
    tier.write_("carries", 0, torch.full((4096,), 7, dtype=torch.uint8)).result()
    out = torch.empty(4096, dtype=torch.uint8)
    tier.read_("carries", 0, out).result()  # the file's descriptors now open
    tier.drop("carries")
    tier.allocate("carries", 1, 8192, torch.uint8)  # another shape: the old files are deleted
    new = torch.arange(8192).to(torch.uint8)
    tier.write_("carries", 0, new).result()
    out = torch.empty(8192, dtype=torch.uint8)
    tier.read_("carries", 0, out).result()
    assert torch.equal(out, new)
    tier.close()


def test_a_pair_forgotten_or_evicted_in_use_closes_when_its_last_user_releases_it(tmp_path):
    paths = [str(tmp_path / f"f{i}") for i in range(3)]
    for path in paths:
        with open(path, "wb") as f:
            f.write(bytes(10))
    before = _open_descriptors()
    handles = OpenFiles(lambda p: files.open_pair(p, os.O_RDWR, False), capacity=2)
    first = handles.acquire(paths[0])
    assert first.size == 10 and handles.acquire(str(tmp_path / "missing")) is None
    for path in paths[1:]:  # the first is evicted, in use
        handles.release(handles.acquire(path))
    assert _is_open(first.fds[1])
    handles.release(first)
    assert not _is_open(first.fds[1])
    again = handles.acquire(paths[1])  # kept open: the same pair
    handles.forget(paths[1])
    assert _is_open(again.fds[1])  # in use: still open
    handles.release(again)
    assert not _is_open(again.fds[1])
    handles.close()
    assert _open_descriptors() == before
