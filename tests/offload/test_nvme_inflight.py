"""Writes left in flight: the NVMe tier orders reads and writes of a row being written, and
train_step returns with the write-behind of the last updated units still running.

A ``Gate`` holds the O_DIRECT writes of chosen files on the I/O threads, so "in flight" is a fact
the test controls, not a race it hopes to win. Every comparison is bitwise.
"""

from __future__ import annotations

import errno
import threading

import pytest
import torch
from ckpt_workers import config, local_rows, model, optimizer
from engine_helpers import batches
from engine_internals import keep_no_rows_resident, log_file_writes, open_on_drain
from nvme_helpers import Gate, all_states, bits, head_row_written

import checkpoints
import zinf_fn as zf
from zinf_fn.offload.nvme import NvmeTier
from zinf_fn.state import view

# -- the tier on its own
# -----------------------------------------------------------------------------


def test_a_read_of_a_row_being_written_gets_the_new_bits_and_a_second_write_waits(
    tmp_path, monkeypatch
):
    tier = NvmeTier(tmp_path, "rank0/optimizer")
    numel = 3 * 4096 + 5
    tier.allocate("blocks/master", 2, numel, torch.float32)
    old, new, newer = (torch.randn(numel) for _ in range(3))
    tier.write_("blocks/master", 1, old).result()
    gate = Gate(monkeypatch, "blocks/master/c/1/")
    first = tier.write_("blocks/master", 1, new)  # held on the I/O threads
    out = torch.empty(numel)
    tier.read_("blocks/master", 1, out).result()
    assert torch.equal(bits(out), bits(new))  # served from the buffer being written
    assert tier.bytes_read_inflight == tier.bytes_read == 4 * numel  # a read, not from the disk
    issued = []
    log_file_writes(monkeypatch, tier, issued)
    second = threading.Thread(target=lambda: tier.write_("blocks/master", 1, newer).result())
    second.start()
    assert not first.done() and issued == []  # the second write waits for the first
    gate.open()
    first.result()
    second.join()
    assert len(issued) == 1
    tier.read_("blocks/master", 1, out).result()  # from the disk now: the last write wins
    assert torch.equal(bits(out), bits(newer)) and (tier.bytes_read, tier.bytes_read_inflight) == (
        8 * numel,
        4 * numel,
    )
    tier.close()


@pytest.mark.parametrize("engine", ["direct", "tensorstore"])
def test_rows_read_back_while_their_writes_run_are_the_written_bits(tmp_path, engine):
    tier = NvmeTier(tmp_path, "rank0/params", engine=engine)
    tier.allocate("blocks/param", 8, 20000, torch.bfloat16)
    rows = [torch.randn(20000).bfloat16() for _ in range(8)]
    futures = [tier.write_("blocks/param", r, src) for r, src in enumerate(rows)]
    for r, src in enumerate(rows):  # in flight or done: the same bits either way
        out = torch.empty(20000, dtype=torch.bfloat16)
        tier.read_("blocks/param", r, out).result()
        assert torch.equal(bits(out), bits(src))
    for f in futures:
        f.result()
    tier.close()


def test_a_failed_write_in_flight_names_its_row_and_the_row_then_reads_from_disk(
    tmp_path, monkeypatch
):
    tier, good = head_row_written(tmp_path)
    gate = Gate(monkeypatch, "head/param", OSError(errno.EIO, "Input/output error"))
    future = tier.write_("head/param", 0, torch.zeros(5000).bfloat16())
    gate.open()
    with pytest.raises(
        OSError, match=r"writing layer head state 'param' \(row 0 of 'head/param'"
    ) as info:
        future.result()
    assert info.value.errno == errno.EIO
    out = torch.empty(5000, dtype=torch.bfloat16)
    tier.read_("head/param", 0, out).result()  # no longer in flight: the disk's (untouched) bits
    assert torch.equal(bits(out), bits(good))
    tier.close()


# -- train_step leaves the last units' writes in flight
# ----------------------------------------------------


def _nvme_state(path):
    return zf.init(model(), optimizer(), config("nvme", str(path), prefetch_depth=2))


def test_the_next_step_reads_rows_still_being_written_and_trains_bitwise_as_in_ram(
    tmp_path, monkeypatch
):
    """The embedding is updated last: its writes are held past the end of step 1, so step 2's
    forward reads its parameters from the buffers being written; the gate opens when step 2 first
    needs the write-behind finished (before it changes an optimizer row). The embedding's row is not
    kept in memory here (``Runtime.keep_first_rows`` off, as for a row too large to keep), so the
    read goes to the tier's writes in flight."""
    data = batches(3)
    ram = zf.init(model(), optimizer(), config("none", prefetch_depth=2))
    for batch in data:
        ram, ram_metrics = zf.train_step(ram, batch)
    keep_no_rows_resident(monkeypatch)
    state = _nvme_state(tmp_path)
    gate = Gate(monkeypatch, "/embed/")
    state, _ = zf.train_step(state, data[0])
    assert (
        gate.holding() and not gate.opened.is_set()
    )  # step 1 returned, the embedding's writes held
    open_on_drain(monkeypatch, state, gate)
    inflight_before = _param_reads_inflight(state)
    for batch in data[1:]:
        state, metrics = zf.train_step(state, batch)
    assert _param_reads_inflight(state) > inflight_before  # the embedding, from RAM
    assert metrics["loss"] == ram_metrics["loss"]
    ours, ref = all_states(state), all_states(ram)
    for name, rows in ref.items():
        assert torch.equal(bits(ours[name]), bits(rows)), name
    zf.close(state)


def _param_reads_inflight(state) -> int:
    """Bytes the param tier has served from writes in flight, so far."""
    return view(state).counters().tiers["param"]["bytes_read_inflight"]


def test_a_save_right_after_a_step_holds_the_updated_state_bitwise(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    state = _nvme_state(tmp_path / "run")
    gate = Gate(monkeypatch, "/embed/")
    state, _ = zf.train_step(state, batches(1)[0])
    assert gate.holding() and not gate.opened.is_set()
    open_on_drain(monkeypatch, state, gate)
    checkpoints.save(str(tmp_path / "ck"), state)  # flushes: opens the gate, waits for the writes
    back = checkpoints.restore(str(tmp_path / "ck"), model(), optimizer(), config("none"))
    ours, theirs = local_rows(state), local_rows(back)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(bits(ours[k]), bits(theirs[k])) for k in ours)
    zf.close(state)


@pytest.mark.parametrize("touch", ["train_step", "eval_step", "save", "close"])
def test_a_deferred_write_that_fails_raises_at_the_next_touch_naming_layer_and_state(
    tmp_path, monkeypatch, touch
):
    state = _nvme_state(tmp_path)
    gate = Gate(monkeypatch, "/embed/", OSError(errno.ENOSPC, "No space left on device"))
    state, _ = zf.train_step(state, batches(1)[0])  # returns: the embedding's writes are held
    assert gate.holding()
    gate.open()  # ... and now fail
    actions = {
        "train_step": lambda: zf.train_step(state, batches(2)[1]),
        "eval_step": lambda: zf.eval_step(state, batches(1)[0]),
        "save": lambda: checkpoints.save(str(tmp_path / "ck"), state),
        "close": lambda: zf.close(state),
    }
    with pytest.raises(
        OSError, match=r"writing layer embed state '(param|master|opt\.\d)'.*No space left"
    ) as info:
        actions[touch]()
    assert info.value.errno == errno.ENOSPC
    if touch != "close":
        view(state).close()  # the error was raised once; closing is clean
