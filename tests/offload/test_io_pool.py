"""The one buffer pool (``zinf_fn.io.BufferPool``): the engine's per-key limit, and what checkpoints
use it for: a byte budget, several buffers taken at once, waiting with an abort event, idle buffers
of other sizes dropped to make room."""

from __future__ import annotations

import threading

import pytest
import torch

from zinf_fn.io.buffers import PAGE, BufferPool, PoolAborted

CPU = torch.device("cpu")


def test_given_buffers_are_taken_again_and_the_limit_raises_saying_how_to_fix_it():
    pool = BufferPool(limit_per_key=2, pin=False)
    a, b = pool.take(1000, torch.float32, "cpu:0"), pool.take(1000, torch.float32, CPU)
    assert a.data_ptr() % PAGE == 0 and b.data_ptr() % PAGE == 0
    with pytest.raises(RuntimeError, match=r"exhausted.*staging_buffers"):
        pool.take(1000, torch.float32, CPU)
    pool.give(a)
    assert pool.idle() == [a]
    assert pool.take(1000, torch.float32, CPU) is a and pool.idle() == []
    assert (pool.count, pool.out, pool.peak_out) == (2, 2, 2)


def test_no_limit_makes_what_is_asked_for():
    pool = BufferPool(limit_per_key=None, pin=False)
    bufs = [pool.take(64, torch.bfloat16, CPU) for _ in range(20)]
    assert pool.count == pool.out == 20
    pool.give_all(bufs)
    assert pool.out == 0 and pool.bytes_made == 20 * 64 * 2


def test_take_all_takes_free_buffers_first_then_makes_the_rest():
    pool = BufferPool(limit_per_key=None, budget_bytes=1 << 20, pin=False)
    first = pool.take_all(
        [(256, torch.float32, CPU), (256, torch.float32, CPU), (128, torch.bfloat16, CPU)]
    )
    pool.give_all(first)
    again = pool.take_all(
        [(256, torch.float32, CPU), (256, torch.float32, CPU), (256, torch.float32, CPU)]
    )
    assert {t.data_ptr() for t in again[:2]} == {t.data_ptr() for t in first[:2]}  # reused
    assert pool.count == 4 and pool.bytes_made == 3 * 1024 + 256
    assert pool.peak_bytes == pool.bytes_made


def test_over_the_budget_without_an_abort_event_raises():
    pool = BufferPool(limit_per_key=None, budget_bytes=4096, pin=False)
    held = pool.take(1024, torch.float32, CPU)  # 4096 bytes: the whole budget
    with pytest.raises(RuntimeError, match="over its budget"):
        pool.take(16, torch.float32, CPU)
    pool.give(held)


def test_always_room_while_nothing_is_out_even_past_the_budget():
    pool = BufferPool(limit_per_key=None, budget_bytes=100, pin=False)
    bufs = pool.take_all(
        [(1000, torch.float32, CPU), (1000, torch.float32, CPU)]
    )  # 8000 bytes > 100
    assert pool.bytes_made == 8000 and pool.out == 2
    pool.give_all(bufs)


def test_idle_buffers_of_other_sizes_are_dropped_to_make_room():
    pool = BufferPool(limit_per_key=None, budget_bytes=10_000, pin=False)
    keep = pool.take(1000, torch.float32, CPU)  # 4000 bytes, out
    idle = pool.take(1000, torch.bfloat16, CPU)  # 2000 bytes
    pool.give(idle)
    big = pool.take(
        1500, torch.float32, CPU
    )  # 6000: fits only once the idle bf16 buffer is dropped
    assert pool.bytes_made == 10_000 and pool.count == 2
    pool.give_all([keep, big])


def test_a_taker_past_the_budget_waits_for_a_buffer_to_come_back():
    pool = BufferPool(limit_per_key=None, budget_bytes=8192, pin=False)
    held = pool.take_all(
        [(1024, torch.float32, CPU), (1024, torch.float32, CPU)]
    )  # the whole budget
    abort, got = threading.Event(), []
    taker = threading.Thread(target=lambda: got.append(pool.take(1024, torch.float32, CPU, abort)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and not got  # waiting, not failing
    pool.give(held[0])
    taker.join(30)
    assert not taker.is_alive() and got[0] is held[0]
    assert pool.count == 2 and pool.bytes_made == 8192


def test_an_aborted_wait_raises_and_hands_nothing_out():
    pool = BufferPool(limit_per_key=None, budget_bytes=4096, pin=False)
    held = pool.take(1024, torch.float32, CPU)
    abort, errors = threading.Event(), []

    def take():
        try:
            pool.take_all([(512, torch.float32, CPU), (512, torch.float32, CPU)], abort)
        except PoolAborted as e:
            errors.append(e)

    taker = threading.Thread(target=take)
    taker.start()
    taker.join(0.2)
    assert taker.is_alive()
    abort.set()
    pool.wake()
    taker.join(30)
    assert not taker.is_alive() and len(errors) == 1
    assert pool.out == 1 and pool.bytes_made == 4096
    pool.give(held)


def test_checkpoint_staging_takes_a_row_at_once_from_the_pool():
    from checkpoints.snapshot import SaveAborted, StagingPool

    staging = StagingPool(budget=3 * 4000)
    row = staging.take(
        {"param": (1000, torch.bfloat16), "master": (1000, torch.float32)}, threading.Event()
    )
    assert row["param"].dtype == torch.bfloat16 and row["master"].numel() == 1000
    assert staging.peak == 6000
    aborted = threading.Event()
    aborted.set()
    with pytest.raises(SaveAborted):  # no room for a second row, and the save is aborted
        staging.take({"param": (1000, torch.float32), "master": (1000, torch.float32)}, aborted)
    staging.give(row)
    again = staging.take(
        {"param": (1000, torch.bfloat16), "master": (1000, torch.float32)}, aborted
    )
    assert again["master"] is row["master"]


def test_huge_pages_are_asked_for_only_where_wanted(monkeypatch):
    from zinf_fn.io import buffers

    advised = []
    monkeypatch.setattr(
        buffers, "advise_huge", lambda address, nbytes: advised.append(nbytes) or True
    )
    big = 4 * buffers.HUGE_PAGE
    assert buffers.aligned_empty(big, torch.uint8).data_ptr() % buffers.HUGE_PAGE == 0
    assert advised == [big]
    buffers.aligned_empty(big, torch.uint8, huge=False)  # a restore's state rows
    BufferPool(limit_per_key=None, pin=False, huge=False).take(
        big, torch.uint8, CPU
    )  # a restore's buffers
    assert advised == [big]
