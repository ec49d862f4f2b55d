"""Rows kept in memory, written through (``zinf_fn.offload.resident``): the NVMe tier serves the
reads of a kept row from its copy once the writes covered them, the disk gets the same bytes, and a
step's forward reads the embedding's and the first block's 16-bit rows without the disk.

Every comparison is bitwise; what the disk holds is read through a fresh tier on the same files (it
keeps nothing, so every read is the disk's).
"""

from __future__ import annotations

import errno

import pytest
import torch
from ckpt_workers import config, model, optimizer
from engine_helpers import batches
from engine_internals import open_on_drain
from nvme_helpers import Gate, all_states, bits

import zinf_fn as zf
from zinf_fn.offload.nvme import NvmeTier
from zinf_fn.state import view

NUMEL = 3 * 4096 + 5


def _tier(path) -> NvmeTier:
    tier = NvmeTier(path, "rank0/params")
    tier.allocate("blocks/param", 2, NUMEL, torch.bfloat16)
    return tier


def _disk(path, row: int) -> torch.Tensor:
    """Row ``row`` of ``blocks/param`` as the disk holds it."""
    fresh = _tier(path)
    out = torch.empty(NUMEL, dtype=torch.bfloat16)
    fresh.read_("blocks/param", row, out).result()
    fresh.close()
    return out


def test_a_kept_row_is_read_from_memory_once_its_writes_cover_the_span(tmp_path):
    tier = _tier(tmp_path)
    tier.keep("blocks/param", 0)
    row = torch.randn(NUMEL).bfloat16()
    out = torch.empty(NUMEL, dtype=torch.bfloat16)
    tier.read_("blocks/param", 0, out).result()  # never written: from the disk (zeros)
    assert tier.bytes_read_resident == 0 and torch.equal(out, torch.zeros_like(out))
    tier.write_("blocks/param", 0, row[:4096].clone(), 0).result()  # the first piece only
    part = torch.empty(4096, dtype=torch.bfloat16)
    tier.read_("blocks/param", 0, part, 0).result()  # covered: from the copy
    assert torch.equal(bits(part), bits(row[:4096])) and tier.bytes_read_resident == 2 * 4096
    tier.read_("blocks/param", 0, out).result()  # the whole row is not covered yet: the disk
    assert tier.bytes_read_resident == 2 * 4096 and torch.equal(bits(out[:4096]), bits(row[:4096]))
    tier.write_("blocks/param", 0, row[4096:].clone(), 4096).result()
    tier.read_("blocks/param", 0, out).result()
    assert torch.equal(bits(out), bits(row)) and tier.bytes_read_resident == 2 * (4096 + NUMEL)
    assert tier.bytes_read == 2 * (3 * NUMEL + 4096)  # counted like every read
    tier.write_("blocks/param", 1, torch.randn(NUMEL).bfloat16()).result()  # row 1 is not kept
    tier.read_("blocks/param", 1, out).result()
    assert tier.bytes_read_resident == 2 * (4096 + NUMEL)
    tier.close()
    assert torch.equal(bits(_disk(tmp_path, 0)), bits(row))  # the disk got the same bytes


def test_a_rerun_keeps_nothing_it_has_not_written_and_a_failed_write_drops_the_copy(
    tmp_path, monkeypatch
):
    first = _tier(tmp_path)
    good = torch.randn(NUMEL).bfloat16()
    first.write_("blocks/param", 0, good).result()
    first.close()
    tier = _tier(tmp_path)  # a rerun opens the files: its copy is empty
    tier.keep("blocks/param", 0)
    out = torch.empty(NUMEL, dtype=torch.bfloat16)
    tier.read_("blocks/param", 0, out).result()
    assert torch.equal(bits(out), bits(good)) and tier.bytes_read_resident == 0
    tier.write_("blocks/param", 0, good).result()  # written whole: kept from now on
    gate = Gate(monkeypatch, "blocks/param/c/0/", OSError(errno.EIO, "Input/output error"))
    failing = tier.write_("blocks/param", 0, torch.zeros(NUMEL).bfloat16())
    gate.open()
    with pytest.raises(OSError, match="writing layer blocks.0 state 'param'"):
        failing.result()
    tier.read_("blocks/param", 0, out).result()  # not the copy of the failed write: the disk's
    assert torch.equal(bits(out), bits(good)) and tier.bytes_read_resident == 0
    tier.close()


def _param_bytes(state, group: str) -> int:
    return view(state).groups[group].part.shard_numel * 2  # bf16


def test_a_step_reads_the_first_rows_from_memory_and_trains_bitwise_as_in_ram(
    tmp_path, monkeypatch
):
    """The embedding and block 0 are updated last; a step's forward needs them first. Their 16-bit
    rows are kept: the next forward reads them from memory, even while their writes are still held
    on the I/O threads (the gate, past the end of step 1). Held too: every write of block 0 and the
    embedding, which a write-behind bounded to ``prefetch_depth`` pieces would wait for before the
    step could return; it returns with all of them in flight (``ReadAhead.room``)."""
    data = batches(3)
    ram = zf.init(model(), optimizer(), config("none", prefetch_depth=2))
    for batch in data:
        ram, ram_metrics = zf.train_step(ram, batch)
    state = zf.init(model(), optimizer(), config("nvme", str(tmp_path), prefetch_depth=2))
    gate = Gate(monkeypatch, r"/(embed|blocks)/[^/]+/c/0/")
    state, _ = zf.train_step(state, data[0])
    assert gate.holding() and not gate.opened.is_set()  # returned: the last two units' writes held
    assert (
        view(state).counters().write_behind_buffers >= 6
    )  # m, v, 16-bit pieces and masters of both units
    open_on_drain(monkeypatch, state, gate)
    kept = _param_bytes(state, "embed") + _param_bytes(state, "blocks")
    for batch in data[1:]:
        state, metrics = zf.train_step(state, batch)
        assert (
            metrics["bytes_read_resident.nvme"] == kept
        )  # the forward's reads of the two rows, no more
    assert metrics["loss"] == ram_metrics["loss"]
    view(state).flush()
    ours, ref = all_states(state), all_states(ram)
    for name, rows in ref.items():
        assert torch.equal(bits(ours[name]), bits(rows)), name
    for group in ("embed", "blocks"):  # the disk holds what the copies served
        disk = NvmeTier(tmp_path, "rank0/params")
        rows = view(state).groups[group].rows
        disk.allocate(
            f"{group}/param", rows, view(state).groups[group].part.shard_numel, torch.bfloat16
        )
        out = torch.empty(view(state).groups[group].part.shard_numel, dtype=torch.bfloat16)
        disk.read_(f"{group}/param", 0, out).result()
        disk.close()
        assert torch.equal(bits(out), bits(ours[f"param:{group}/param"][0])), group
    view(state).close()
